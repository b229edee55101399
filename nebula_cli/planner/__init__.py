"""The planner: the 2022 scheduling paper's cost model and placement search
(`plan_placement`), and the sync advisor (`advise`: how many inner steps, which codec).

Modules: costmodel (the score), graphs (bottleneck matching, open tour), evaluator (budget,
time limit and progress), incremental (re-scoring a swap), bounds (the lower bound), localsearch
(swap moves), moves and scale (the searches from SCALE_FROM devices), search (hybrid genetic
search and the baselines), placement (the library call behind `nebula plan placement`),
scenarios (paper and synthetic networks, devices JSON), measured (bench-network's JSON), advisor
(the sync advisor).
"""

from nebula_cli.planner.advisor import Advice, Prediction, advise, spec_lines
from nebula_cli.planner.costmodel import Cost, CostModel, Network, PlanError, Task
from nebula_cli.planner.measured import devices_from_spec, load_netbench, wan_link
from nebula_cli.planner.placement import Placement, PlacementResult, explain, plan_placement
from nebula_cli.planner.scenarios import PAPER_SCENARIOS, Scenario, load_devices, random_sites

__all__ = [
    "PAPER_SCENARIOS", "Advice", "Cost", "CostModel", "Network", "PlanError", "Placement",
    "PlacementResult", "Prediction", "Scenario", "Task", "advise", "devices_from_spec",
    "explain", "load_devices", "load_netbench", "plan_placement", "random_sites", "spec_lines",
    "wan_link",
]
