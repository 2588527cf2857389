"""
The GPU check: every CUDA path of the repository run and measured by one command, section by
section, each figure printed beside what plan.py predicts for it.

    python -m tools.gpu_check                      # on a GPU: appends each section to results/gpu.md
    python -m tools.gpu_check --smoke              # the same code at tiny sizes on the CPU (< 1 min)
    python -m tools.gpu_check --sections 3,5       # only these sections (a rerun after a fix)

Its sections, their time boxes and how to run it on a lent GPU machine: docs/devices.md.
"""

import argparse
import datetime
import os
import signal
import sys
import time
import traceback

import torch

from tools.gpu_correctness import correctness
from tools.gpu_measurements import (checkpoint_dcp, end_to_end, loss_costs, machine, moe_8x1b,
                                    throughput_350m, wide_7b)
from tools.gpu_steps import PLAN_MFU, REPO, Check, GiB, SectionSkipped

# `shrink` overrides every config's width: the smoke run's models are tiny
SIZES = {
    "gpu": dict(matmul=8192, loss_shape=(4, 256, 256, 2048),
                small=dict(n_embd=256, n_head=4, block_size=256, ffn_hidden=512, vocab_size=2048),
                shrink={}, warmup=3, steps=10, loss_steps=6, wide_batch=8, wide_seq=2048,
                wide_micro=4, moe_batch=8, ckpt_layers=4, e2e_iters=200, e2e_compile=True,
                e2e_args=[], compile_backend="inductor",
                budget={1: 20, 2: 75, 3: 200, 4: 40, 5: 75, 6: 60, 7: 45, 8: 90}),
    "smoke": dict(matmul=256, loss_shape=(2, 16, 8, 32),
                  small=dict(n_embd=32, n_head=2, block_size=16, ffn_hidden=64, vocab_size=64),
                  shrink=dict(n_embd=32, n_head=2, ffn_hidden=64, block_size=32, vocab_size=128),
                  warmup=1, steps=2, loss_steps=1, wide_batch=2, wide_seq=32, wide_micro=2,
                  moe_batch=2, ckpt_layers=2, e2e_iters=4, e2e_compile=False,
                  e2e_args=["--eval_iters=1", "--final_eval=False", "--batch_size=2", "--n_layer=1",
                            "--n_embd=32", "--n_head=2", "--block_size=32", "--log_interval=1"],
                  compile_backend="aot_eager",
                  budget={n: 600 for n in range(1, 9)}),  # correctness, not speed, here
}

SECTIONS = {1: ("Machine", machine), 2: ("Correctness on the device", correctness),
            3: ("Throughput at 350M", throughput_350m), 4: ("Each loss's cost at 350M", loss_costs),
            5: ("The 7B recipe's width at 2 and 4 blocks", wide_7b), 6: ("MoE 8x1B at 2 blocks", moe_8x1b),
            7: ("Checkpoint (DCP)", checkpoint_dcp), 8: ("End to end", end_to_end)}


class SectionTimeout(Exception):
    pass


def run_section(check, number):
    """One section under its time box; -> whether it passed."""
    title, fn = SECTIONS[number]
    left = check.deadline - time.monotonic()
    check.line(f"\n## {number}. {title}\n")
    if left < 5:
        check.line("not run: the check's time budget (--budget) was spent")
        return False
    limit = min(check.sizes["budget"][number], left)
    t0 = time.monotonic()
    ok = True
    # each section compiles as a fresh train.py process would (section 4 reuses section 3's model)
    if number != 4:
        torch._dynamo.reset()

    def alarm(signum, frame):
        raise SectionTimeout(f"stopped after its {limit:.0f} s time box")
    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, limit)
    start = len(check.text)
    try:
        fn(check)
        failed = sum("**FAILED**" in line for line in check.text[start:])
        if failed:
            ok = False
            check.line(f"\n**FAILED**: {failed} of this section's checks (marked above)")
    except SectionSkipped as e:
        check.line(f"\nskipped: {e}")
    except Exception as e:  # noqa: BLE001 -- the next section must run whatever this one hit
        ok = False
        message = str(e).strip()
        where = traceback.extract_tb(e.__traceback__)[-1]
        check.line(f"\n**FAILED**: {type(e).__name__}: {message.splitlines()[0] if message else ''} "
                   f"({os.path.basename(where.filename)}:{where.lineno})")
        if not isinstance(e, SectionTimeout):
            traceback.print_exc()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    check.line(f"\n_section time: {time.monotonic() - t0:.1f} s_")
    check.reset_memory()
    check.save()
    return ok


def header(check):
    if check.cuda:
        props = torch.cuda.get_device_properties(check.device)
        gpu = f"{props.name}, {props.total_memory / GiB:.1f} GiB, {props.multi_processor_count} SMs"
    else:
        gpu = f"none: --smoke on the CPU ({os.cpu_count()} cores)"
    check.line("# The GPU check (tools/gpu_check.py)\n")
    check.line(f"- device: {gpu}")
    check.line(f"- torch {torch.__version__}, CUDA {torch.version.cuda}, Python {sys.version.split()[0]}")
    check.line(f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
    check.line(f"- command: `python -m tools.gpu_check {' '.join(sys.argv[1:])}`")
    check.line(f"- MFU is against {check.peak / 1e12:.0f} TFLOP/s (the H100/H200 bf16 dense datasheet peak); "
               f"the plan's times assume MFU {PLAN_MFU}"
               if check.cuda else "- MFU is against this CPU's measured bf16 matmul")
    check.save()


def main():
    parser = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes on the CPU, nothing written unless --out")
    parser.add_argument("--out", default=None, help="the report (default results/gpu.md; none with --smoke)")
    parser.add_argument("--sections", default="1,2,3,4,5,6,7,8", help="which sections, e.g. 3,4")
    parser.add_argument("--data_dir", default="",
                        help="section 8's dataset (prepare_c4.py; the docstring says how)")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds for the whole check, each section also time-boxed "
                             "(default 330; --smoke: 3600)")
    args = parser.parse_args()
    try:
        sections = [int(s) for s in args.sections.split(",")]
        assert all(s in SECTIONS for s in sections)
    except (ValueError, AssertionError):
        parser.error(f"--sections must be numbers from 1 to {len(SECTIONS)} separated by commas, got "
                     f"{args.sections!r}")
    device = "cpu" if args.smoke else "cuda"
    if not args.smoke:
        if not torch.cuda.is_available():
            parser.error("no CUDA device here: use --smoke to run the check at tiny sizes on the CPU")
        if args.out is None:
            args.out = os.path.join(REPO, "results", "gpu.md")
        torch.set_float32_matmul_precision("high")  # as train.py does on CUDA
    if args.budget is None:
        args.budget = 3600 if args.smoke else 330
    check = Check(device, SIZES["smoke" if args.smoke else "gpu"], args.out, args.data_dir, args.budget)
    header(check)
    t0 = time.monotonic()
    failed = [n for n in sections if not run_section(check, n)]
    check.line(f"\nTotal: {time.monotonic() - t0:.0f} s; sections failed: "
               f"{', '.join(map(str, failed)) or 'none'}")
    check.save()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
