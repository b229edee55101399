"""What a round's decision says of the next round, as one object carried whole.

The coordinator's :class:`~nebula_cli.relay.protocol.agreement.Decision` carries a
:class:`NextRound`; every relay's outcome of that round
(:class:`~nebula_cli.relay.protocol.results.RoundOutcome`) carries it on to its worker in the
round's RESULT, the client's ``RoundResult`` hands it to the runtime, rank 0 broadcasts it to
the cluster's ranks (``runtime.cluster_share``), and each rank's cadence follows it
(``runtime.cadence.Cadence.follow``). Its fields travel at the top level of those messages'
meta under the keys of :meth:`NextRound.to_meta`, read back by :meth:`NextRound.from_meta`: a
new field is added here, in those two methods, and where it is used.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from nebula_cli.relay.net.schema import Fields
from nebula_cli.relay.protocol.pacing import CODEC_CHARS

WHY_CHARS = 400
"""The longest explanation of a choice a decision carries."""


@dataclass(frozen=True)
class NextRound:
    """The next round as the relays agreed it (every field: None or "" when not said, and the
    cluster keeps what it has)."""

    h: int | None = None
    """``inner_steps: auto``: the H every cluster trains before its next round (>= 1)."""
    merge: int | None = None
    """Overlap: the step after its boundary at which every cluster applies the next round's
    average (>= 1; ``relay.protocol.pacing.choose_merge_steps``)."""
    codec: str = ""
    """``compression: auto``: the codec every cluster encodes its next round with."""
    why: str = ""
    """What ``h`` and ``codec`` were chosen from (``relay.protocol.pacing``,
    ``relay.codecs.choice``), for the logs and metrics."""

    def to_meta(self) -> dict[str, Any]:
        """The keys a decision, a round's RESULT and the cluster's broadcast carry."""
        return {"next_h": self.h, "next_merge": self.merge, "next_codec": self.codec,
                "why": self.why}

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any], what: str = "next round") -> NextRound:
        """From a message's meta (its other keys ignored); MessageError when a value is of
        the wrong type or out of range. A codec name and an explanation are cut to
        CODEC_CHARS and WHY_CHARS."""
        f = Fields(what, meta)
        return cls(f.integer("next_h", None, low=1), f.integer("next_merge", None, low=1),
                   f.text("next_codec", "", max_chars=CODEC_CHARS),
                   f.text("why", "", max_chars=WHY_CHARS))
