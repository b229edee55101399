"""`StudentLinks`: the students' links of a label relay and what each may hold. A student
cluster has at most its slots in the plan plus one links (a rank's new link replaces its older
one: a rank that dialled again after a cut is not refused), each link at most ``max_asks``
asks outstanding (asked, not yet answered or failed), and the relay's queue at most
``queue_tokens`` tokens. Not thread-safe: the relay calls it under its lock."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from nebula_cli.relay.distill.link import LabelLink

QUEUE_TOKENS = 1 << 22
"""The most tokens a label relay queues for its servers, over all students (~12 MiB of ids)."""


def max_asks(lookahead: int) -> int:
    """Asks a student's link may have outstanding: an honest loader (`DistillLoader`) holds
    the batch it is taking and ``lookahead`` + 1 asked ahead of it."""
    return lookahead + 2


@dataclass
class Student:
    """One student's link: its cluster and rank, and its asks outstanding."""

    link: LabelLink
    cluster: str
    rank: int
    outstanding: int = 0


class StudentLinks:
    """The links of the students ``slots`` (cluster -> its ranks in the plan)."""

    def __init__(self, slots: Mapping[str, int]) -> None:
        self.slots = dict(slots)
        self._by_link: dict[LabelLink, Student] = {}

    def __len__(self) -> int:
        return len(self._by_link)

    def links(self) -> list[LabelLink]:
        return list(self._by_link)

    def of(self, link: LabelLink) -> Student:
        return self._by_link[link]

    def get(self, link: LabelLink) -> Student | None:
        """The student of ``link``, None once it is gone (or replaced)."""
        return self._by_link.get(link)

    def add(self, link: LabelLink, cluster: str, rank: int) -> tuple[Student | None, str | None]:
        """Take ``link`` of ``cluster``'s rank ``rank``: (the student it replaces, to be
        ended), or the refusal when the cluster holds its links already."""
        mine = [s for s in self._by_link.values() if s.cluster == cluster]
        old = next((s for s in mine if s.rank == rank), None)
        cap = self.slots[cluster] + 1
        if old is None and len(mine) >= cap:
            return None, (f"cluster {cluster} holds {len(mine)} links to this label relay "
                          f"already, the most it may ({self.slots[cluster]} slots in the plan, "
                          "plus one); a rank's new link replaces its own older one")
        if old is not None:
            del self._by_link[old.link]
        self._by_link[link] = Student(link, cluster, rank)
        return old, None

    def remove(self, link: LabelLink) -> None:
        self._by_link.pop(link, None)
