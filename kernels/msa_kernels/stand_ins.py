"""The CuTeDSL launchers without a GPU: every compiled kernel replaced by a stand-in that launches nothing.

stand_in_kernels(make) routes msa_kernels.ops to the CuTeDSL launchers as on a Hopper GPU, whatever the tensors'
device (the H200's 132 SMs for split-K sizing), and gives every launcher make(kernel_cls, params) where it would
compile that kernel (runtime.compiled_kernel). Two stand-ins:

- no_op: launches nothing; bench_host_overhead.py --python-only times what remains of a layer call, its Python.
- SignatureCheck: checks each call's arguments against kernel_cls.fake_arguments(params) as the compiled function
  checks them on the GPU before a launch (fake.py): their count; None exactly where the symbolic argument is None;
  each tensor's dtype, rank, innermost stride 1 and declared alignment (base and outer strides); one device for
  all tensors; Python ints for Int32 scalars and floats for Float32 ones. It records each launch (kernel class,
  params). The CPU tests run every launcher through it, so an argument passed in the wrong place, dtype or layout
  fails in CI rather than on the GPU. It checks what a launcher passes, not what a kernel computes: the GPU tests
  (tests/test_cute_kernels.py) compare that with the PyTorch reference.
"""

import contextlib
import importlib
import pkgutil
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch


def no_op(kernel_cls: type, params) -> Callable:
    return lambda *args: None


class Launch(NamedTuple):
    kernel: str  # the kernel class's name
    params: object
    args: tuple  # what the launcher passed (tensors and scalars, the stream left out)


class SignatureCheck:
    """A stand-in maker (stand_in_kernels) whose kernels check their arguments; `launches` lists the calls made."""

    def __init__(self) -> None:
        self.launches: list[Launch] = []

    def __call__(self, kernel_cls: Any, params) -> Callable:
        *symbolic, stream = kernel_cls.fake_arguments(params)
        assert type(stream).__name__ == "_FakeStream", f"{kernel_cls.__name__}: fake_arguments must end with the stream"
        name = kernel_cls.__name__

        def launch(*args):
            check_arguments(name, symbolic, args)
            self.launches.append(Launch(name, params, args))

        return launch

    def kernels(self) -> list[str]:
        """The kernel classes launched, in order."""
        return [launch.kernel for launch in self.launches]


def check_arguments(kernel: str, symbolic: list, args: tuple) -> None:
    """AssertionError naming the kernel and the argument where args do not match the symbolic arguments."""
    import cutlass

    assert len(args) == len(symbolic), f"{kernel}: {len(args)} arguments, the kernel takes {len(symbolic)}"
    devices = set()
    for i, (arg, fake) in enumerate(zip(args, symbolic)):
        where = f"{kernel} argument {i}"
        if fake is None:
            assert arg is None, f"{where}: None expected, got {type(arg).__name__}"
        elif isinstance(fake, cutlass.Int32):
            assert isinstance(arg, int) and not isinstance(arg, bool), f"{where}: an int expected, got {arg!r}"
        elif isinstance(fake, cutlass.Float32):
            assert isinstance(arg, float), f"{where}: a float expected, got {arg!r}"
        else:
            assert isinstance(arg, torch.Tensor), f"{where}: a tensor expected, got {type(arg).__name__}"
            _check_tensor(where, fake, arg)
            devices.add(arg.device)
    assert len(devices) <= 1, f"{kernel}: tensors on {sorted(map(str, devices))}"


def _check_tensor(where: str, fake, tensor: torch.Tensor) -> None:
    import cutlass

    dtypes = {
        cutlass.BFloat16: torch.bfloat16,
        cutlass.Float16: torch.float16,
        cutlass.Float32: torch.float32,
        cutlass.Int32: torch.int32,
        cutlass.Int64: torch.int64,
        cutlass.Float8E4M3FN: torch.float8_e4m3fn,
    }
    want = dtypes[fake.element_type]
    assert tensor.dtype == want, f"{where}: {want} expected, got {tensor.dtype}"
    assert tensor.dim() == len(fake.shape), f"{where}: rank {len(fake.shape)} expected, got {tuple(tensor.shape)}"
    assert tensor.shape[-1] == 1 or tensor.stride(-1) == 1, f"{where}: innermost stride {tensor.stride(-1)}"
    align = fake._assumed_align
    if align:
        assert tensor.data_ptr() % align == 0, f"{where}: base not {align}-byte aligned"
        for extent, stride in zip(tensor.shape[:-1], tensor.stride()[:-1]):
            assert extent == 1 or stride * tensor.element_size() % align == 0, (
                f"{where}: strides {tensor.stride()} not {align}-byte multiples"
            )


def _cute_modules() -> list:
    import msa_kernels.cute as cute_kernels

    names = [info.name for info in pkgutil.iter_modules(cute_kernels.__path__)]
    return [importlib.import_module(f"msa_kernels.cute.{name}") for name in names]


def _clear_caches(modules: list) -> None:
    """The functools caches of these modules (routing, compiled kernels, launch plans): none outlives a swap."""
    for module in modules:
        for value in vars(module).values():
            if hasattr(value, "cache_clear") and getattr(value, "__module__", None) == module.__name__:
                value.cache_clear()


@contextlib.contextmanager
def stand_in_kernels(make: Callable[[type, object], Callable]) -> Iterator[None]:
    """msa_kernels.ops routed as on a Hopper GPU, every compiled kernel make(kernel_cls, params), inside the block."""
    from msa_kernels import ops

    modules = [ops, *_cute_modules()]
    patches: list[tuple[Any, str, Callable]] = [(ops, "_on_hopper", lambda device: True)]
    for module in modules[1:]:
        if hasattr(module, "compiled_kernel"):
            patches.append((module, "compiled_kernel", make))
        if hasattr(module, "num_sms"):
            patches.append((module, "num_sms", lambda device_index: 132))  # the H200's
    saved = [(module, name, getattr(module, name)) for module, name, _ in patches]
    _clear_caches(modules)
    try:
        for module, name, value in patches:
            setattr(module, name, value)
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)
        _clear_caches(modules)
