"""Programmatic dependent launch (PDL) for the decode chain: index scores -> top-k -> sparse attention ->
combine.

Each kernel of the chain is launched with use_pdl=True and calls wait_for_previous_kernel before it
touches global memory: the GPU may then launch it while the kernel before it on the stream is still
finishing (once that one's CTAs have all triggered, or exited), and griddepcontrol.wait holds its CTAs until
that grid has completed and its writes are visible, whatever the kernel before was (one of these, a torch op,
vLLM's cache write). Every kernel triggers only after its own wait, so at most two grids of the stream are
resident at once and a kernel two launches later still sees every write before it. Kernels launched without
the attribute (torch ops) wait for full completion of the one before, as always.
"""

import cutlass.cute as cute


@cute.jit
def wait_for_previous_kernel():
    """griddepcontrol.wait, then griddepcontrol.launch_dependents: the next kernel of the stream may launch
    now (its own wait holds it until this grid completes)."""
    cute.arch.griddepcontrol_wait()
    cute.arch.griddepcontrol_launch_dependents()
