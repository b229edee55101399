"""What a round's decision says of the next round, as one object carried whole.

The coordinator's :class:`~nebula_cli.relay.protocol.agreement.Decision` carries a
:class:`NextRound`; every relay's outcome of that round
(:class:`~nebula_cli.relay.protocol.results.RoundOutcome`) carries it on to its worker in the
round's RESULT, the client's ``RoundResult`` hands it to the runtime, rank 0 broadcasts it to
the cluster's ranks (``runtime.cluster_share``), and each rank's cadence follows it
(``runtime.cadence.Cadence.follow``). Its fields travel at the top level of those messages'
meta under the keys its fields declare (:mod:`nebula_cli.relay.net.schema`): a new field is
added here, and where it is used.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from nebula_cli.relay.net.schema import wire
from nebula_cli.relay.protocol.pacing import CODEC_CHARS

WHY_CHARS = 400
"""The longest explanation of a choice a decision carries."""


@dataclass(frozen=True, kw_only=True)
class NextRound:
    """The next round as the relays agreed it (every field: None or "" when not said, and the
    cluster keeps what it has). Its fields travel at the top level of the messages that carry
    it (``wire(flat=True)``), under the keys below; a forged value is refused, a codec name and
    an explanation are cut to CODEC_CHARS and WHY_CHARS."""

    NAME: ClassVar[str] = "next round"

    h: int | None = wire(None, key="next_h", low=1)
    """``inner_steps: auto``: the H every cluster trains before its next round (>= 1)."""
    merge: int | None = wire(None, key="next_merge", low=1)
    """Overlap: the step after its boundary at which every cluster applies the next round's
    average (>= 1; ``relay.protocol.pacing.choose_merge_steps``)."""
    codec: str = wire("", key="next_codec", max_chars=CODEC_CHARS)
    """``compression: auto``: the codec every cluster encodes its next round with."""
    why: str = wire("", max_chars=WHY_CHARS)
    """What ``h`` and ``codec`` were chosen from (``relay.protocol.pacing``,
    ``relay.codecs.choice``), for the logs and metrics."""
