"""The round protocol across relays: the round driver (``rounds``) and the parts it owns
(``round_state``: what it holds; ``round_control``: round control with peers; ``recovery``:
fetching, catching up, averaging alone), the network as it sees it (``network``), its messages
(``messages``), who takes part (``agreement``), the averaging schedule (``allreduce``),
histories (``lineage``), the next round's H and weights (``pacing``), what the next round is
(``next_round``), what a round leaves (``results``), and catch-up transfers (``fetch``)."""
