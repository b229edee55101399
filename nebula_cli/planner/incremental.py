"""Incremental evaluation: the score of a partition one swap away from a scored one, re-scoring
only what the swap touches.

Swapping device u (group a) with v (group b) changes two groups. Their data-parallel costs are
recomputed from their members' sums (2 x dp^2 additions, the same arithmetic in the same order as
a full evaluation, so the result is bit for bit the same); only the 2 x (stages - 1) links
between a or b and another group are computed again (up to EXACT_TOUR_MAX stages matched,
through the model's cache, each starting from the parent's matching; above, only bounded, in one
vectorised step, see CostModel.pipeline_on_bounds); every other group's cost and link is kept.
The pipeline order is then recomputed from the link matrix: it is a function of the links only,
so a partition's score never depends on the path that reached it, and incremental and full
evaluation agree exactly (tests/planner/test_scale.py).
"""

from __future__ import annotations

import numpy as np

from nebula_cli.planner.costmodel import Cost, CostModel, Evaluation, Hint
from nebula_cli.planner.graphs import EXACT_TOUR_MAX, open_tour


def swapped(labels: np.ndarray, groups: np.ndarray, u: int,
            v: int) -> tuple[np.ndarray, np.ndarray]:
    """Labels and groups (rows sorted) after swapping devices u and v."""
    a, b = int(labels[u]), int(labels[v])
    new_labels = labels.copy()
    new_labels[u], new_labels[v] = b, a
    new_groups = groups.copy()
    row_a, row_b = new_groups[a], new_groups[b]
    row_a[row_a == u] = v
    row_b[row_b == v] = u
    row_a.sort()
    row_b.sort()
    return new_labels, new_groups


def swap_evaluation(model: CostModel, parent: Evaluation, parent_groups: np.ndarray,
                    groups: np.ndarray, u: int, v: int) -> Evaluation:
    """The evaluation of `groups` (rows sorted): the parent's partition with device u (group a)
    and v (group b) swapped. Each new link's matching starts from the parent's."""
    a = int(np.nonzero((groups == v).any(axis=1))[0][0])
    b = int(np.nonzero((groups == u).any(axis=1))[0][0])
    d = groups.shape[0]
    group_data = parent.group_data.copy()
    if model.task.dp > 1:
        group_data[[a, b]] = model.group_data_costs(groups[[a, b]])
    links = parent.links.copy()
    others = [c for c in range(d) if c != a and c != b]
    pi = [a] * (d - 1) + [b] * (d - 2)
    pj = [b, *others, *others]
    def hint(grp: int, c: int) -> Hint:
        """The parent's pair (grp, c), grp the changed group a or b."""
        first, second = parent_groups[grp], parent_groups[c]
        if first[0] > second[0]:
            first, second = second, first
        return first.tobytes() + second.tobytes(), *((u, v) if grp == a else (v, u))

    def hint_of(i: int, j: int) -> Hint | None:
        if (i in (a, b)) == (j in (a, b)):
            return None  # both changed (no parent pair to start from), or neither (cached)
        return hint(i, j) if i in (a, b) else hint(j, i)

    if d > EXACT_TOUR_MAX:
        values = model.link_bounds(groups, np.array(pi), np.array(pj))
        links[pi, pj] = values
        links[pj, pi] = values
        pipeline, order = model.pipeline_on_bounds(groups, links, hint_of)
    else:
        hints: list[Hint | None] = [None, *(hint(a, c) for c in others),
                                    *(hint(b, c) for c in others)]
        values = model.link_values(groups, pi, pj, hints)
        links[pi, pj] = values
        links[pj, pi] = values
        pipeline, order = open_tour(links)
    data = float(group_data.max())
    return Evaluation(Cost(data + 2 * pipeline, data, pipeline), order, group_data, links)
