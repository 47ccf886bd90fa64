"""Programmatic dependent launch (PDL) for the decode chain: index scores -> top-k -> sparse attention ->
combine.

Each kernel of the chain is launched with use_pdl=True and calls wait_for_previous_kernel before it
touches global memory: the GPU may then launch a kernel while the one before it on the stream is still
finishing (its CTAs are scheduled and their prologue runs), and griddepcontrol.wait holds them until that
grid has completed and its writes are visible. Where the kernel before was not launched this way (a torch
op, vLLM's cache write) or there is none, the wait returns at once: launched this way a kernel starts only
once its predecessor has completed, as without PDL.
"""

import cutlass.cute as cute


@cute.jit
def wait_for_previous_kernel():
    """griddepcontrol.wait, then griddepcontrol.launch_dependents: the next kernel of the stream may launch
    now (its own wait holds it until this grid completes)."""
    cute.arch.griddepcontrol_wait()
    cute.arch.griddepcontrol_launch_dependents()
