"""``vlkv kernels compile``: every Triton kernel specialization the product launches, compiled ahead of time
for sm_80/90/100 with its resources (``deploy/kernel_compile.py``); no GPU needed."""

from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser("kernels", help="ahead-of-time checks of the Triton kernels (no GPU needed)")
    ksub = p.add_subparsers(dest="kernels_command", required=True)
    kp = ksub.add_parser(
        "compile",
        help="compile every kernel specialization the product launches for sm_80/90/100; report registers, "
        "shared memory, spills, occupancy; exit 1 on an error, a spill or occupancy under a floor",
    )
    from vlkv.deploy.kernel_compile import add_args as add_compile_args

    add_compile_args(kp)
    kp.set_defaults(func=cmd_kernels)


def cmd_kernels(args) -> int:
    from vlkv.deploy.kernel_compile import run

    return run(args)
