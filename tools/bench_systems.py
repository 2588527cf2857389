"""
tools/bench.py's sections that set what plan.py and the data and model code predict against what a
run measures: the GPU memory of the paper configs (gpu_memory), the plan's memory against real
short runs (plan_memory), its bytes sent per step against every collective of a real step
(plan_comm, CollectiveBytes), prepare_c4.py's throughput (prepare) and the MoE layer's forward
(moe). `python -m tools.bench --section X` runs them; the module docstring there says what each
measures.
"""

import json
import math
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import parallelism
import memory
import plan
from errors import UserError
from model import GPTConfig, MixtureOfExperts, build_model
from objective import Objective, objective_step
from optim import configure_optimizers
from tools.bench_losses import emit, table
from utils import seconds

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def expert_loop(moe, x):
    """MixtureOfExperts.forward before issue 31, for timing: a loop over the experts, each on the
    tokens routed to it (torch.where: a data-dependent shape, a host sync on a GPU), nothing dropped."""
    probs = F.softmax(moe.router(x), dim=-1)
    top_p, top_e = probs.topk(moe.top_k, dim=-1)
    top_p = top_p / top_p.sum(dim=-1, keepdim=True)
    out = torch.zeros_like(x)
    for e in range(moe.gate.size(0)):
        token, slot = torch.where(top_e == e)
        h = F.silu(F.linear(x[token], moe.gate[e])) * F.linear(x[token], moe.up[e])
        out.index_add_(0, token, F.linear(h, moe.down[e]) * top_p[token, slot, None])
    return out


def routing(moe, dropless, capacity_factor):
    """Switch one MixtureOfExperts between its paths (moe.py) without rebuilding it."""
    moe.dropless, moe.capacity_factor = dropless, capacity_factor


def moe_times(C, H, N, steps, warmup, device, factors=(1.0, 1.25, 2.0, 0.0)):
    """{way: (median seconds of one MoE layer's forward + backward, median share of slots dropped)}
    for the per-expert loop, the static forward at each capacity factor and the dropless one, in turn
    (a background load slows all alike). 8 experts, top-2, weights N(0, 0.01): a near-uniform router."""
    torch.manual_seed(0)
    moe = MixtureOfExperts(GPTConfig(arch="llama", n_embd=C, n_head=1, ffn_hidden=H, n_expert=8,
                                     top_k=2)).to(device)
    for p in moe.parameters():
        torch.nn.init.normal_(p, 0.0, 0.01)
    x = torch.randn(N, C, device=device)
    ways = {"loop over experts (before)": lambda: expert_loop(moe, x)}
    for factor in factors:
        ways[f"static, capacity_factor {factor}"] = (
            lambda f: lambda: routing(moe, False, f) or moe(x))(factor)
    ways["dropless (sorted by expert)"] = lambda: routing(moe, True, 0.0) or moe(x)
    times, dropped = {name: [] for name in ways}, {name: [] for name in ways}
    for i in range(warmup + steps):
        for name, forward in ways.items():
            moe.zero_grad(set_to_none=True)
            elapsed = seconds(lambda: forward().square().mean().backward(), device)
            if i >= warmup:
                times[name].append(elapsed)
                dropped[name].append(moe.dropped_fraction.item() if name.startswith("static") else 0.0)
    return {name: (statistics.median(times[name]), statistics.median(dropped[name])) for name in ways}


def moe(args, device, dtype):
    """One MoE layer at half the 8x1B width (C 1024, H 2816, 8 experts, top-2) on one 2048-token
    sequence, float32: the per-expert loop against the static and dropless forwards (moe.py)."""
    times = moe_times(1024, 2816, 2048, args.steps, args.warmup, device)
    base = times["loop over experts (before)"][0]
    table("one MoE layer, forward + backward (C 1024, H 2816, 8 experts, top-2, 2048 tokens, float32)",
          ["forward", "median ms", "ratio to the loop", "slots dropped"],
          [(name, f"{1000 * t:.0f}", f"{t / base:.2f}", f"{100 * d:.1f} %")
           for name, (t, d) in times.items()])


PAPER_CONFIGS = ["config/c4_tiny.py", "config/baseline_350m.py", "config/baseline_1b3.py",
                 "config/baseline_3b.py", "config/baseline_7b.py", "config/baseline_moe_8x1b.py"]


def gpu_memory(args, device, dtype):
    """tools/memory_table.py's table for the paper configs on 8 GPUs, and what it means for the biggest."""
    from tools import memory_table as gpu
    emit("\n### GPU memory of the paper configs (tools/memory_table.py, 8 GPUs)\n")
    for line in gpu.table_lines([os.path.join(REPO, p) for p in PAPER_CONFIGS], gpus=8):
        emit(line)
    config = gpu.read_config(os.path.join(REPO, "config/baseline_7b.py"))
    n = plan.make_plan(config, 8, measure=False)["params"]
    emit("\nWeights, gradients and AdamW moments are fp32, 16 bytes per parameter: on one GPU the 7B "
         f"model's states alone are {16 * n / memory.GiB:.0f} GiB. With several micro-steps per step FSDP2 "
         f"also keeps the gradients unsharded between them (4 bytes per parameter, {4 * n / memory.GiB:.0f} "
         "GiB at 7B), counted in the table. Activations are per micro-batch, measured in fp32 (bf16 "
         "autocast stores most at half size). `python train.py CONFIG --dry_run=True` prints the whole plan "
         "of a run (plan.py).")


# (name, train.py arguments, processes): real runs whose peak memory is set against the plan's figure
PLAN_MEMORY_RUNS = [
    ("c4_tiny", ["config/c4_tiny.py"], 1),
    ("c4_tiny, activation checkpointing", ["config/c4_tiny.py", "--activation_checkpointing=True"], 1),
    ("350M width, 2 blocks", ["config/baseline_350m.py", "--n_layer=2", "--parallel=none",
                              "--global_batch_size=0"], 1),
    ("c4_tiny, DDP on 2 gloo processes", ["config/c4_tiny.py", "--parallel=ddp"], 2),
    ("c4_tiny, FSDP on 2 gloo processes", ["config/c4_tiny.py", "--parallel=fsdp"], 2),
]


def peak_rss_gib(command):
    """Peak resident memory of a command's largest process (the command or any process it waited
    for, e.g. torchrun's workers), GiB; the command must succeed."""
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               text=True)
    _, status, usage = os.wait4(process.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise UserError(f"{' '.join(command)} failed: {process.stderr.read()[-2000:]}")
    return usage.ru_maxrss * 1024 / memory.GiB  # Linux: KiB


def plan_memory(args, device, dtype):
    """The plan's memory for a process (memory.process_gib: what train.py's memory check uses)
    against the peak resident memory of the same run, --steps training steps with an evaluation
    every 2 and a checkpoint, on this machine, --repeats times: the peak moves from run to run
    (glibc's heap, kept at its peak by utils.keep_freed_memory, fragments differently with the
    address-space layout). The process's own footprint (Python, torch, the data's memmap
    untouched) is measured apart, as the peak of a process that imports what train.py imports,
    and taken off: the plan counts the run's tensors, and on the CPU the heap's allowance
    (memory.CPU_HEAP_ALLOWANCE x the step's transient tensors), which this table calibrates: its
    last column is that fraction as each row's median peak implies it."""
    from configurator import parse_config, train_defaults
    data_dir = os.environ.get("PLAN_MEMORY_DATA", "data/c4_tiny")
    if not os.path.exists(os.path.join(REPO, data_dir, "meta.json")):
        raise UserError(f"plan_memory needs C4-format data in {data_dir}: python prepare_c4.py --from_text "
                        f"input.txt --out_dir {data_dir} (or set PLAN_MEMORY_DATA)")
    imports = ("import numpy, torch, tqdm, checkpoint, evaluate, metrics, parallelism, plan, "
               "prepare_shakespeare, tracking")
    base = peak_rss_gib([sys.executable, "-c", imports])
    short = [f"--max_iters={args.steps}", "--eval_interval=2", "--eval_iters=1", "--log_interval=1",
             "--final_eval=False", f"--data_dir={data_dir}", "--overwrite=True"]
    rows = []
    for name, train_args, processes in PLAN_MEMORY_RUNS:
        launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={processes}"] \
            if processes > 1 else [sys.executable]
        out_dir = os.path.join(REPO, "out", "bench_plan_memory")
        peaks = sorted(peak_rss_gib([*launcher, "train.py", *train_args, *short,
                                     f"--out_dir={out_dir}"]) - base
                       for _ in range(args.repeats))
        median = statistics.median(peaks)
        config = {**parse_config([*train_args, *short], train_defaults()), "dtype": "float32"}
        vocab = plan.run_vocab(config)
        tensors, states = memory.process_gib(config, processes, vocab)
        heap = memory.cpu_heap_allowance(processes)
        planned = memory.process_gib(config, processes, vocab, heap=heap)[0]
        implied = (median - tensors) / (tensors - states)
        rows.append((name, str(processes), f"{states:.3f}", f"{tensors:.3f}", f"{planned:.3f}",
                     " / ".join(f"{p:.3f}" for p in (peaks[0], median, peaks[-1])),
                     f"{100 * (planned - median) / median:+.0f} %", f"{implied:.2f}"))
    table(f"The plan's memory per process against the measured peak (CPU, float32, {args.steps} steps, "
          f"{args.repeats} runs each)",
          ["run", "processes", "plan: states GiB", "plan: tensors GiB", "plan: with heap GiB",
           "measured peak GiB, min / median / max", "plan error (median)", "heap fraction implied"], rows,
          intro=f"Measured peak: the run's largest process's peak resident set minus {base:.3f} GiB, the "
                "peak of a process that only imports what train.py imports. Heap: memory.CPU_HEAP_ALLOWANCE "
                f"= {memory.CPU_HEAP_ALLOWANCE}, as fractions of the step's transient tensors.")


# plan_comm: the runs whose collectives are counted, on 2 gloo processes in one process group: the 350M
# width (d = 1024, 16 heads, SwiGLU 2371) cut to 2 blocks with a 4096-token vocabulary, so that the blocks
# and the roots (embedding and head; NITP's head, the objective's own unit) weigh alike, 64-token sequences
COMM_MODEL = ["config/baseline_350m.py", "--n_layer=2", "--vocab_size=4096", "--block_size=64",
              "--batch_size=1", "--nitp_weight=1.0", "--grad_clip_mode=norm"]
# (the FSDP runs differ in micro-steps and in the all-gathers' dtype, and neither product is the other's)
COMM_RUNS = {
    "DDP, 2 micro-steps": ["--parallel=ddp", "--global_batch_size=4", "--dtype=float32"],
    "DDP, 4 micro-steps": ["--parallel=ddp", "--global_batch_size=8", "--dtype=float32"],
    "FSDP, 4 micro-steps, activation checkpointing": ["--parallel=fsdp", "--global_batch_size=8",
                                                      "--dtype=float32", "--activation_checkpointing=True"],
    "FSDP, 2 micro-steps, bf16 all-gathers": ["--parallel=fsdp", "--global_batch_size=4", "--dtype=bfloat16"],
    "FSDP, 4 micro-steps, kept gathered": ["--parallel=fsdp", "--global_batch_size=8", "--dtype=float32",
                                           "--fsdp_keep_gathered=True"],
}


class CollectiveBytes(TorchDispatchMode):
    """Sums, by kind, the buffer of every collective the operations run under it call (c10d's ops,
    which DDP's reducer and FSDP2 call, and the functional ones): the whole tensor gathered
    (all-gather), scattered (reduce-scatter's input) or reduced (all-reduce). Calls of other
    collectives are counted by name. Not seen: what a DTensor runs inside the dispatch of an
    operation on it (under FSDP, clipping's all-reduce of the gradient norm, one scalar)."""

    KINDS = {"gather": "all_gather", "reduce_scatter": "reduce_scatter", "allreduce": "all_reduce",
             "all_reduce": "all_reduce"}

    def __init__(self):
        super().__init__()
        self.buffers = dict.fromkeys(("all_gather", "reduce_scatter", "all_reduce"), 0)
        self.calls, self.other = {}, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace in ("c10d", "_c10d_functional") and func._opname != "wait_tensor":
            kind = next((k for name, k in self.KINDS.items() if name in func._opname), None)
            functional = func.namespace == "_c10d_functional"
            if kind is None:
                self.other[str(func)] = self.other.get(str(func), 0) + 1
                return out
            # c10d's in-place ops name the gathered tensor first and the tensor to scatter second
            buffer = {"all_gather": out if functional else args[0],
                      "reduce_scatter": args[0] if functional else args[1], "all_reduce": args[0]}[kind]
            self.buffers[kind] += sum(t.numel() * t.element_size() for t in tree_flatten(buffer)[0]
                                      if isinstance(t, torch.Tensor))
            self.calls[str(func)] = self.calls.get(str(func), 0) + 1
        return out


def comm_child():
    """Under torchrun: one optimizer step of each of COMM_RUNS, counted (CollectiveBytes), as train.py
    steps: gradient sync in the last micro-step only, then its global-norm clipping and AdamW. Rank 0
    prints a JSON line per run: the bytes each process sent by plan.py's ring convention, the calls
    counted, and the calls of other collectives."""
    from configurator import parse_config, train_defaults
    from optim import apply_gradients
    rank, _, world = parallelism.init_distributed("cpu")
    for name, keys in COMM_RUNS.items():
        config = parse_config([*COMM_MODEL, *keys], train_defaults())
        if config["parallel"] == "fsdp" and parallelism.fsdp_unavailable("cpu"):
            if rank == 0:
                print(json.dumps({"run": name, "skipped": parallelism.fsdp_unavailable("cpu")}), flush=True)
            continue
        torch.manual_seed(0)
        model = build_model(GPTConfig.from_config(config, plan.run_vocab(config)))
        objective = Objective.from_config(config)
        objective.init_weights()
        if config["activation_checkpointing"]:
            parallelism.apply_activation_checkpointing(model)
        param_dtype = None if config["dtype"] == "float32" else getattr(torch, config["dtype"])
        keep = config["fsdp_keep_gathered"]
        train_model, train_objective = parallelism.parallelize(model, objective, config["parallel"], "cpu",
                                                               param_dtype, keep_gathered=keep)
        optimizers = configure_optimizers(model, 1e-4, 0.1, (0.9, 0.95), extra_modules=[objective])
        micro_steps = memory.micro_steps_of(config, world)
        x = torch.randint(0, model.config.vocab_size, (config["batch_size"], config["block_size"]))
        with CollectiveBytes() as counter:
            for micro_step in range(micro_steps):
                with parallelism.gradient_sync((train_model, train_objective), micro_step == micro_steps - 1,
                                               keep):
                    loss, *_ = objective_step(model, objective, x, x, train_model, train_objective)
                    (loss / micro_steps).backward()
            apply_gradients(optimizers, torch.amp.GradScaler("cpu", enabled=False),
                            lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), config["grad_clip"]))
        share = (world - 1) / world
        sent = {kind: buffer * share * (2 if kind == "all_reduce" else 1)
                for kind, buffer in counter.buffers.items()}
        if rank == 0:
            print(json.dumps({"run": name, "processes": world, "micro_steps": micro_steps, "sent": sent,
                              "calls": counter.calls, "other": counter.other}), flush=True)
    parallelism.shutdown()


def plan_comm(args, device, dtype):
    """plan.py's bytes per optimizer step and process (comms.communication_bytes) against the bytes every
    collective of a real step moved (comm_child, 2 gloo processes)."""
    from configurator import parse_config, train_defaults
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
               "tools.bench", "--comm_child"]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    if result.returncode != 0:
        raise UserError(f"{' '.join(command)} failed: {result.stderr[-2000:]}")
    rows = []
    for record in (json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")):
        if "skipped" in record:
            rows.append((record["run"], "skipped: " + record["skipped"], "", "", "", ""))
            continue
        config = parse_config([*COMM_MODEL, *COMM_RUNS[record["run"]]], train_defaults())
        planned = plan.make_plan(config, record["processes"], measure=False)["communication"]
        counted = sum(record["sent"].values())
        rows.append((record["run"], ", ".join(f"{n} {op.split('.')[1]}" for op, n in record["calls"].items()),
                     ", ".join(f"{k} {v / 1e6:,.1f}" for k, v in record["sent"].items() if v),
                     f"{counted / 1e6:,.1f}", f"{planned['total'] / 1e6:,.1f}",
                     f"{100 * (planned['total'] - counted) / counted:+.1f} %"))
    table("The plan's communication per optimizer step and process against the collectives of a real step "
          "(2 gloo processes)", ["run", "calls", "counted MB, by kind", "counted MB", "plan MB",
                                 "plan error"], rows,
          intro="MB sent per process (1e6 bytes), ring convention: all-gather and reduce-scatter (N-1)/N of "
                "the whole buffer, all-reduce twice that (plan.py). The 350M width at 2 blocks, vocabulary "
                "4096, NITP's head, T = 64, batch 1 per process.")


PREPARE_COPIES = 16          # tiny Shakespeare x 16: 4 train shards of ~4 MB of JSON + 1 val shard
PREPARE_DOC_PARAGRAPHS = 12  # speeches per document: ~2 KB, about a C4 document's length
C4_SHARD_TOKENS = 150e6      # GPT-2 tokens in one C4 "en" train shard, roughly (plan.C4_TOKENS_PER_SHARD)
C4_SHARD_GZ_BYTES = 320e6    # the compressed shard a worker waits for: ~305 GB / 1024 shards (allenai/c4 en)


def _child_cpu_seconds():
    import resource
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # finished children and what they waited for
    return usage.ru_utime + usage.ru_stime


def prepare_throughput(args, device, dtype):
    """prepare_c4.py end to end (the real script in a subprocess: worker start-up, gzip, JSON,
    tokenising, writing, the index) with 1 and 2 workers, alternating with tiktoken on 1 thread
    over the same documents in this process, so a background load slows both alike. Wall time
    and CPU time (the script's processes, getrusage) are both given: the wall-clock share of
    tiktoken x workers needs idle cores; the CPU-time share (the work per token, whatever the
    load) is what a 32-core node with a core per worker gets, and the prediction uses it, with
    the tokens per CPU-second measured here (Shakespeare's text; C4's web text has longer tokens)."""
    import gzip
    import re
    import shutil
    import tempfile

    import tiktoken
    from data import BPE_ENCODING

    text_path = os.environ.get("PREPARE_TEXT", os.path.join(REPO, "data", "shakespeare_char", "input.txt"))
    if not os.path.isfile(text_path):
        raise UserError(f"the prepare section needs tiny Shakespeare at {text_path}: python "
                        "prepare_shakespeare.py (or set PREPARE_TEXT to a plain-text file)")
    work = tempfile.mkdtemp(prefix="bench_prepare_")
    try:
        with open(text_path, encoding="utf-8") as f:
            speeches = [s.strip("\n") for s in re.split(r"\n\s*\n", f.read()) if s.strip()] * PREPARE_COPIES
        big = os.path.join(work, "input.txt")  # documents of 12 speeches, as --from_text cuts them
        with open(big, "w", encoding="utf-8") as out:
            out.write("\n\n".join("\n".join(speeches[i:i + PREPARE_DOC_PARAGRAPHS])
                                  for i in range(0, len(speeches), PREPARE_DOC_PARAGRAPHS)) + "\n")
        out_dir = os.path.join(work, "c4")
        # PREPARE_SCRIPT: another version of the script to time the same way (e.g. an older commit's)
        script = os.environ.get("PREPARE_SCRIPT", os.path.join(REPO, "prepare_c4.py"))
        command = [sys.executable, script, "--from_text", big, "--shards", "4", "--out_dir", out_dir]
        env = {**os.environ, "PYTHONPATH": REPO}
        # makes the shards
        subprocess.run(command + ["--workers", "1"], check=True, capture_output=True, env=env)
        docs, json_bytes = [], 0
        for name in sorted(os.listdir(out_dir)):
            if name.endswith(".json.gz"):
                with gzip.open(os.path.join(out_dir, name), "rb") as f:
                    for line in f:
                        docs.append(json.loads(line)["text"])
                        json_bytes += len(line)
        enc = tiktoken.get_encoding(BPE_ENCODING)
        n_tokens = sum(len(ids) + 1 for ids in enc.encode_ordinary_batch(docs, num_threads=1))  # + EOT each
        runs = {1: [], 2: []}
        tiktoken_runs, loop_runs, parse_runs = [], [], []
        for _ in range(max(args.steps, 1)):
            for workers in runs:
                for old in ("train", "val", "meta.json", "train.bin", "val.bin"):
                    path = os.path.join(out_dir, old)
                    if os.path.isdir(path):
                        shutil.rmtree(path)
                    elif os.path.exists(path):
                        os.remove(path)
                t0, c0 = time.perf_counter(), _child_cpu_seconds()
                subprocess.run(command + ["--workers", str(workers)], check=True, capture_output=True,
                               env=env)
                runs[workers].append((time.perf_counter() - t0, _child_cpu_seconds() - c0))
                t0, c0 = time.perf_counter(), time.process_time()
                enc.encode_ordinary_batch(docs, num_threads=1)
                tiktoken_runs.append((time.perf_counter() - t0, time.process_time() - c0))
            t0, c0 = time.perf_counter(), time.process_time()
            for doc in docs:
                enc.encode_ordinary(doc)
            loop_runs.append((time.perf_counter() - t0, time.process_time() - c0))
            # what the main process did twice per shard before
            t0, c0 = time.perf_counter(), time.process_time()
            for name in sorted(os.listdir(out_dir)):
                if name.endswith(".json.gz"):
                    with gzip.open(os.path.join(out_dir, name), "rb") as f:
                        for line in f:
                            json.loads(line)
            parse_runs.append((time.perf_counter() - t0, time.process_time() - c0))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    wall, cpu = (statistics.median(r[i] for r in tiktoken_runs) for i in (0, 1))
    rows = [("tiktoken encode_ordinary_batch, 1 thread", "-", f"{wall:.1f}", f"{json_bytes / 1e6 / wall:.1f}",
             f"{n_tokens / wall / 1e6:.2f}", "1.00", f"{cpu:.1f}", "1.00")]
    for what, measured in (("tiktoken encode_ordinary, a loop", loop_runs),
                           ("gzip + JSON of the shards alone (no tokenising)", parse_runs)):
        w, c = (statistics.median(r[i] for r in measured) for i in (0, 1))
        rows.append((what, "-", f"{w:.1f}", f"{json_bytes / 1e6 / w:.1f}", "", f"{wall / w:.2f}", f"{c:.1f}",
                     f"{cpu / c:.2f}"))
    parse_cpu = statistics.median(r[1] for r in parse_runs)
    cpu_share = {}
    for workers, measured in runs.items():
        w, c = (statistics.median(r[i] for r in measured) for i in (0, 1))
        cpu_share[workers] = cpu / c
        rows.append((f"{os.path.basename(script)} --workers {workers}", workers, f"{w:.1f}",
                     f"{json_bytes / 1e6 / w:.1f}",
                     f"{n_tokens / w / 1e6:.2f}", f"{wall / w / workers:.2f}", f"{c:.1f}", f"{cpu / c:.2f}"))
    table(f"prepare_c4.py against tiktoken, {json_bytes / 1e6:.0f} MB of JSON ({n_tokens / 1e6:.1f}M tokens, "
          f"{len(docs):,} documents, 5 shards), {os.cpu_count()} cores",
          ["", "workers", "wall s", "MB/s of JSON", "M tokens/s", "/ (tiktoken x workers)", "CPU s",
           "tiktoken CPU s / CPU s"], rows,
          intro=f"Whole script runs, medians of {max(args.steps, 1)} alternating runs. Wall: the throughput "
                "over tiktoken's single-core speed times the workers (needs that many idle cores). CPU: all "
                "the script's processes (main, workers, their start-up) against tiktoken's CPU time for the "
                "same tokens.")
    per_core = n_tokens / cpu * cpu_share[1]  # tokens per CPU-second of the script's one process
    startup = (statistics.median(r[1] for r in runs[2]) - statistics.median(r[1] for r in runs[1]))
    shard_s = C4_SHARD_TOKENS / per_core
    rounds = math.ceil(350 / 32)
    emit("- before issue 31 the main process decompressed and parsed every shard twice (a checking pass, "
         "then the batches it sent to the pool): it keeps at most tiktoken CPU s / (2 x gzip + JSON CPU s) "
         f"= {cpu / (2 * parse_cpu):.1f} workers busy on this text, whatever the cores (less the pickling of "
         "the batches); now each worker reads its own shards and the main process only downloads and writes "
         "the index.")
    emit(f"- predicted for 350 C4 shards (~{C4_SHARD_TOKENS / 1e6:.0f}M tokens each) with 32 workers: "
         f"{shard_s:.0f} s of tokenising per shard and worker, {rounds} rounds of 32 shards = "
         f"{rounds * shard_s / 60:.0f} min (plus about {startup:.1f} CPU-s to start each worker: the "
         f"2-worker run's extra CPU time), if the downloads keep up: 32 shards per {shard_s:.0f} s is "
         f"{32 * C4_SHARD_GZ_BYTES / shard_s / 1e6:.0f} MB/s of gzipped shards; below that the download (one "
         f"stream, in the main process) sets the pace: 350 x {C4_SHARD_GZ_BYTES / 1e6:.0f} MB at the link's "
         "speed.")

