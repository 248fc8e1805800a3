"""Child processes we own (a host's Gym deployment and uv, a trainer's local hosts): their
output logged, their trees stopped with the owner.

Nothing here knows what the children are (uv, a Gym deployment); it knows how to start them,
hear them, and make sure none outlives the task — or the process — that owns it.
"""

from trio_gym.processes.output import OutputTail
from trio_gym.processes.tree import ProcessTree, run_process_tree

__all__ = ["OutputTail", "ProcessTree", "run_process_tree"]
