"""The round protocol across relays: the round driver (``rounds``), who takes part
(``agreement``), the averaging schedule (``allreduce``), histories (``lineage``), the next
round's H and weights (``pacing``), what a round leaves (``results``), and catch-up transfers
(``fetch``, ``recovery``)."""
