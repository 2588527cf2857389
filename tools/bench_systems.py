"""
tools/bench.py's sections on what plan.py and the data and model code
predict against what a run measures. Results: docs/performance.md.
"""

import gzip
import json
import math
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from functools import partial

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import memory
import parallelism
import plan
from errors import UserError
from model import GPTConfig, MixtureOfExperts, build_model
from objective import Objective, Trained
from optim import apply_gradients, configure_optimizers
from tools.bench_losses import REPO, alternate, emit, run_child, table
from tools.memory_table import read_config, table_lines

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def expert_loop(moe, x):
    """MixtureOfExperts.forward before issue 31: a loop over the experts,
    nothing dropped."""
    probs = F.softmax(moe.router(x), dim=-1)
    top_p, top_e = probs.topk(moe.top_k, dim=-1)
    top_p = top_p / top_p.sum(dim=-1, keepdim=True)
    out = torch.zeros_like(x)
    for e in range(moe.gate.size(0)):
        token, slot = torch.where(top_e == e)
        h = F.silu(F.linear(x[token], moe.gate[e])) * F.linear(x[token], moe.up[e])
        out.index_add_(0, token, F.linear(h, moe.down[e]) * top_p[token, slot, None])
    return out


def moe_times(C, H, N, steps, warmup, device, factors=(1.0, 1.25, 2.0, 0.0)):
    """{way: (median seconds of forward + backward, median share of slots
    dropped)} of one MoE layer, each way in turn; weights N(0, 0.01) make
    the router near-uniform."""
    torch.manual_seed(0)
    moe = MixtureOfExperts(GPTConfig(arch="llama", n_embd=C, n_head=1, ffn_hidden=H, n_expert=8,
                                     top_k=2)).to(device)
    for p in moe.parameters():
        torch.nn.init.normal_(p, 0.0, 0.01)
    x = torch.randn(N, C, device=device)
    routings = {"loop over experts (before)": None,  # (dropless, capacity_factor)
                **{f"static, capacity_factor {f}": (False, f) for f in factors},
                "dropless (sorted by expert)": (True, 0.0)}
    dropped = {name: [] for name in routings}

    def step(name):
        moe.zero_grad(set_to_none=True)
        if routings[name]:
            moe.dropless, moe.capacity_factor = routings[name]  # switch paths without rebuilding
        (moe(x) if routings[name] else expert_loop(moe, x)).square().mean().backward()
        dropped[name].append(moe.dropped_fraction.item() if name.startswith("static") else 0.0)
    times = alternate({name: partial(step, name) for name in routings}, steps, warmup, device)
    return {name: (t, statistics.median(dropped[name][warmup:])) for name, t in times.items()}


def moe(args, device, dtype):
    times = moe_times(1024, 2816, 2048, args.steps, args.warmup, device)
    base = times["loop over experts (before)"][0]
    table("one MoE layer, forward + backward (C 1024, H 2816, 8 experts, top-2, 2048 tokens, float32)",
          ["forward", "median ms", "ratio to the loop", "slots dropped"],
          [(name, f"{1000 * t:.0f}", f"{t / base:.2f}", f"{100 * d:.1f} %")
           for name, (t, d) in times.items()])


PAPER_CONFIGS = ["c4_tiny", "baseline_350m", "baseline_1b3", "baseline_3b", "baseline_7b",
                 "baseline_moe_8x1b"]


def gpu_memory(args, device, dtype):
    paths = {name: os.path.join(REPO, "config", f"{name}.py") for name in PAPER_CONFIGS}
    emit("\n### GPU memory of the paper configs (tools/memory_table.py, 8 GPUs)\n")
    emit("\n".join(table_lines(paths.values(), gpus=8)))
    n = plan.make_plan(read_config(paths["baseline_7b"]), 8, measure=False)["params"]
    emit("\nWeights, gradients and AdamW moments are fp32, 16 bytes per parameter: on one GPU the 7B "
         f"model's states alone are {16 * n / memory.GiB:.0f} GiB. With several micro-steps per step FSDP2 "
         f"also keeps the gradients unsharded between them (4 bytes per parameter, {4 * n / memory.GiB:.0f} "
         "GiB at 7B), counted in the table. Activations are per micro-batch, measured in fp32 (bf16 "
         "autocast stores most at half size). `python train.py CONFIG --dry_run=True` prints the whole plan "
         "of a run (plan.py).")


# (name, train.py arguments, processes)
PLAN_MEMORY_RUNS = [
    ("c4_tiny", ["config/c4_tiny.py"], 1),
    ("c4_tiny, activation checkpointing", ["config/c4_tiny.py", "--activation_checkpointing=True"], 1),
    ("350M width, 2 blocks", ["config/baseline_350m.py", "--n_layer=2", "--parallel=none",
                              "--batch_size=1", "--global_batch_size=0"], 1),
    ("c4_tiny, DDP on 2 gloo processes", ["config/c4_tiny.py", "--parallel=ddp"], 2),
    ("c4_tiny, FSDP on 2 gloo processes", ["config/c4_tiny.py", "--parallel=fsdp"], 2),
]


def peak_rss_gib(command):
    """Peak resident GiB of a command's largest process (it or one it
    waited for, e.g. torchrun's workers)."""
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               text=True)
    _, status, usage = os.wait4(process.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise UserError(f"{' '.join(command)} failed: {process.stderr.read()[-2000:]}")
    return usage.ru_maxrss * 1024 / memory.GiB  # Linux: KiB


def plan_memory(args, device, dtype):
    data_dir = os.environ.get("PLAN_MEMORY_DATA", "data/c4_tiny")
    if not os.path.exists(os.path.join(REPO, data_dir, "meta.json")):
        raise UserError(f"plan_memory needs C4-format data in {data_dir}: python prepare_c4.py --from_text "
                        f"input.txt --out_dir {data_dir} (or set PLAN_MEMORY_DATA)")
    imports = ("import numpy, torch, tqdm, checkpoint, scoring, metrics, parallelism, plan, "
               "prepare_shakespeare, tracking")
    base = peak_rss_gib([sys.executable, "-c", imports])
    short = [f"--max_iters={args.steps}", "--eval_interval=2", "--eval_iters=1", "--log_interval=1",
             "--final_eval=False", f"--data_dir={data_dir}", "--overwrite=True",
             f"--out_dir={os.path.join(REPO, 'out', 'bench_plan_memory')}"]
    rows = []
    for name, train_args, processes in PLAN_MEMORY_RUNS:
        launcher = [*TORCHRUN, f"--nproc_per_node={processes}"] if processes > 1 else [sys.executable]
        command = [*launcher, "train.py", *train_args, *short]
        peaks = sorted(peak_rss_gib(command) - base for _ in range(args.repeats))
        median = statistics.median(peaks)
        config = {**read_config(*train_args, *short), "dtype": "float32"}
        tensors, states = memory.process_gib(config, processes, plan.run_vocab(config))
        planned = tensors + memory.cpu_heap_allowance(processes) * (tensors - states)
        rows.append((name, processes, f"{states:.3f}", f"{tensors:.3f}", f"{planned:.3f}",
                     " / ".join(f"{p:.3f}" for p in (peaks[0], median, peaks[-1])),
                     f"{100 * (planned - median) / median:+.0f} %",
                     f"{(median - tensors) / (tensors - states):.2f}"))
    table(f"The plan's memory per process against the measured peak (CPU, float32, {args.steps} steps, "
          f"{args.repeats} runs each)",
          ["run", "processes", "plan: states GiB", "plan: tensors GiB", "plan: with heap GiB",
           "measured peak GiB, min / median / max", "plan error (median)", "heap fraction implied"], rows,
          intro=f"Measured peak: the run's largest process's peak resident set minus {base:.3f} GiB, the "
                "peak of a process that only imports what train.py imports. Heap: memory.CPU_HEAP_ALLOWANCE "
                f"= {memory.CPU_HEAP_ALLOWANCE}, as fractions of the step's transient tensors.")


# a 4096-token vocabulary, so that the blocks and the roots (embeddings,
# head, NITP's head) weigh alike
COMM_MODEL = ["config/baseline_350m.py", "--n_layer=2", "--vocab_size=4096", "--block_size=64",
              "--batch_size=1", "--nitp_weight=1.0", "--grad_clip_mode=norm", "--dtype=float32"]
# (the FSDP runs vary micro-steps and the all-gathers' dtype apart)
COMM_RUNS = {
    "DDP, 2 micro-steps": ["--parallel=ddp", "--global_batch_size=4"],
    "DDP, 4 micro-steps": ["--parallel=ddp", "--global_batch_size=8"],
    "FSDP, 4 micro-steps, activation checkpointing":
        ["--parallel=fsdp", "--global_batch_size=8", "--activation_checkpointing=True"],
    "FSDP, 2 micro-steps, bf16 all-gathers":
        ["--parallel=fsdp", "--global_batch_size=4", "--dtype=bfloat16"],
    "FSDP, 4 micro-steps, kept gathered":
        ["--parallel=fsdp", "--global_batch_size=8", "--fsdp_keep_gathered=True"],
}


class CollectiveBytes(TorchDispatchMode):
    """Sums, by kind, the whole buffer of every collective called under it
    (c10d's ops, as DDP and FSDP2 call them, and the functional ones);
    other collectives' calls by name. Not seen: what a DTensor runs
    inside an op's dispatch (FSDP clipping's all-reduce of one scalar)."""

    KINDS = {"gather": "all_gather", "reduce_scatter": "reduce_scatter", "allreduce": "all_reduce",
             "all_reduce": "all_reduce"}

    def __init__(self):
        super().__init__()
        self.buffers = dict.fromkeys(self.KINDS.values(), 0)
        self.calls = Counter()
        self.other = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace not in ("c10d", "_c10d_functional") or func._opname == "wait_tensor":
            return out
        kind = next((k for name, k in self.KINDS.items() if name in func._opname), None)
        if kind is None:
            self.other[str(func)] += 1
            return out
        # c10d's in-place ops name the gathered tensor first and the tensor to scatter second
        functional = func.namespace == "_c10d_functional"
        buffer = {"all_gather": out if functional else args[0],
                  "reduce_scatter": args[0] if functional else args[1], "all_reduce": args[0]}[kind]
        self.buffers[kind] += sum(t.numel() * t.element_size() for t in tree_flatten(buffer)[0]
                                  if isinstance(t, torch.Tensor))
        self.calls[str(func)] += 1
        return out


def comm_child():
    """Under torchrun: one optimizer step of each of COMM_RUNS, counted by
    CollectiveBytes; rank 0 prints a JSON line per run (bytes sent by
    plan.py's convention)."""
    rank, _, world = parallelism.init_distributed("cpu")
    for name, keys in COMM_RUNS.items():
        config = read_config(*COMM_MODEL, *keys)
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
        wrapper = parallelism.parallelize(Trained(model, objective), config["parallel"], "cpu",
                                          param_dtype, keep_gathered=keep)
        optimizers = configure_optimizers(model, 1e-4, 0.1, (0.9, 0.95), extra_modules=[objective])
        micro_steps = memory.micro_steps_of(config, world)
        x = torch.randint(0, model.config.vocab_size, (config["batch_size"], config["block_size"]))
        with CollectiveBytes() as counter:
            for micro_step in range(micro_steps):
                with parallelism.gradient_sync(wrapper, micro_step == micro_steps - 1, keep):
                    loss, *_ = wrapper(x, x)
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
    command = [*TORCHRUN, "--standalone", "--nproc_per_node=2", "-m", "tools.bench", "--comm_child"]
    rows = []
    for record in run_child(command, OMP_NUM_THREADS="1"):
        if "skipped" in record:
            rows.append((record["run"], "skipped: " + record["skipped"], "", "", "", ""))
            continue
        config = read_config(*COMM_MODEL, *COMM_RUNS[record["run"]])
        planned = plan.make_plan(config, record["processes"], measure=False)["communication"]["total"]
        counted = sum(record["sent"].values())
        rows.append((record["run"], ", ".join(f"{n} {op.split('.')[1]}" for op, n in record["calls"].items()),
                     ", ".join(f"{k} {v / 1e6:,.1f}" for k, v in record["sent"].items() if v),
                     f"{counted / 1e6:,.1f}", f"{planned / 1e6:,.1f}",
                     f"{100 * (planned - counted) / counted:+.1f} %"))
    table("The plan's communication per optimizer step and process against the collectives of a real step "
          "(2 gloo processes)", ["run", "calls", "counted MB, by kind", "counted MB", "plan MB",
                                 "plan error"], rows,
          intro="MB sent per process (1e6 bytes), ring convention: all-gather and reduce-scatter (N-1)/N of "
                "the whole buffer, all-reduce twice that (plan.py). The 350M width at 2 blocks, vocabulary "
                "4096, NITP's head, T = 64, batch 1 per process.")


PREPARE_COPIES = 16          # tiny Shakespeare x 16: 4 train shards of ~4 MB of JSON + 1 val shard
PREPARE_DOC_PARAGRAPHS = 12  # speeches per document: ~2 KB, about a C4 document's length
C4_SHARD_GZ_BYTES = 320e6    # the compressed shard a worker waits for: ~305 GB / 1024 shards (allenai/c4 en)


def children_cpu_seconds():
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # finished children and what they waited for
    return usage.ru_utime + usage.ru_stime


def wall_and_cpu(work, cpu_seconds=time.process_time):
    wall, cpu = time.perf_counter(), cpu_seconds()
    work()
    return time.perf_counter() - wall, cpu_seconds() - cpu


def shard_lines(out_dir):
    for name in sorted(os.listdir(out_dir)):
        if name.endswith(".json.gz"):
            with gzip.open(os.path.join(out_dir, name), "rb") as f:
                yield from f


def prepare_throughput(args, device, dtype):
    """prepare_c4.py with 1 and 2 workers, in turn with tiktoken on 1
    thread over the same documents; the C4 prediction uses CPU time, the
    work per token whatever the load."""
    import tiktoken
    from data import BPE_ENCODING

    text_path = os.environ.get("PREPARE_TEXT", os.path.join(REPO, "data", "shakespeare_char", "input.txt"))
    if not os.path.isfile(text_path):
        raise UserError(f"the prepare section needs tiny Shakespeare at {text_path}: python "
                        "prepare_shakespeare.py (or set PREPARE_TEXT to a plain-text file)")
    with open(text_path, encoding="utf-8") as f:
        speeches = [s.strip("\n") for s in re.split(r"\n\s*\n", f.read()) if s.strip()] * PREPARE_COPIES
    # PREPARE_SCRIPT: another version of the script to time the same way (e.g. an older commit's)
    script = os.environ.get("PREPARE_SCRIPT", os.path.join(REPO, "prepare_c4.py"))
    enc = tiktoken.get_encoding(BPE_ENCODING)
    runs = {way: [] for way in ("tiktoken", "loop", "parse", 1, 2)}  # 1, 2: workers
    with tempfile.TemporaryDirectory(prefix="bench_prepare_", ignore_cleanup_errors=True) as work:
        big = os.path.join(work, "input.txt")  # documents of 12 speeches, as --from_text cuts them
        with open(big, "w", encoding="utf-8") as out:
            out.write("\n\n".join("\n".join(speeches[i:i + PREPARE_DOC_PARAGRAPHS])
                                  for i in range(0, len(speeches), PREPARE_DOC_PARAGRAPHS)) + "\n")
        out_dir = os.path.join(work, "c4")
        command = [sys.executable, script, "--from_text", big, "--shards", "4", "--out_dir", out_dir]
        prepare = {w: partial(run_child, [*command, "--workers", str(w)], PYTHONPATH=REPO) for w in (1, 2)}
        prepare[1]()  # makes the shards
        lines = list(shard_lines(out_dir))
        docs = [json.loads(line)["text"] for line in lines]
        json_bytes = sum(len(line) for line in lines)
        n_tokens = sum(len(ids) + 1 for ids in enc.encode_ordinary_batch(docs, num_threads=1))  # + EOT each

        def encode_loop():
            for doc in docs:
                enc.encode_ordinary(doc)

        def parse_shards():  # what the main process did twice per shard before
            for line in shard_lines(out_dir):
                json.loads(line)
        for _ in range(args.steps):
            for workers in prepare:
                for old in ("train", "val", "meta.json", "train.bin", "val.bin"):
                    path = os.path.join(out_dir, old)
                    if os.path.isdir(path):
                        shutil.rmtree(path)
                    elif os.path.exists(path):
                        os.remove(path)
                runs[workers].append(wall_and_cpu(prepare[workers], children_cpu_seconds))
                runs["tiktoken"].append(wall_and_cpu(lambda: enc.encode_ordinary_batch(docs, num_threads=1)))
            runs["loop"].append(wall_and_cpu(encode_loop))
            runs["parse"].append(wall_and_cpu(parse_shards))
    wall, cpu = map(statistics.median, zip(*runs["tiktoken"]))

    def row(what, measured, workers=None, tokens=True):
        w, c = map(statistics.median, zip(*measured))
        return (what, workers or "-", f"{w:.1f}", f"{json_bytes / 1e6 / w:.1f}",
                f"{n_tokens / w / 1e6:.2f}" if tokens else "", f"{wall / w / (workers or 1):.2f}",
                f"{c:.1f}", f"{cpu / c:.2f}")
    rows = [row("tiktoken encode_ordinary_batch, 1 thread", runs["tiktoken"]),
            row("tiktoken encode_ordinary, a loop", runs["loop"], tokens=False),
            row("gzip + JSON of the shards alone (no tokenising)", runs["parse"], tokens=False),
            *(row(f"{os.path.basename(script)} --workers {w}", runs[w], w) for w in prepare)]
    table(f"prepare_c4.py against tiktoken, {json_bytes / 1e6:.0f} MB of JSON ({n_tokens / 1e6:.1f}M tokens, "
          f"{len(docs):,} documents, 5 shards), {os.cpu_count()} cores",
          ["", "workers", "wall s", "MB/s of JSON", "M tokens/s", "/ (tiktoken x workers)", "CPU s",
           "tiktoken CPU s / CPU s"], rows,
          intro=f"Whole script runs, medians of {args.steps} alternating runs. Wall: the throughput "
                "over tiktoken's single-core speed times the workers (needs that many idle cores). CPU: all "
                "the script's processes (main, workers, their start-up) against tiktoken's CPU time for the "
                "same tokens.")
    cpu_of = {way: statistics.median(c for _, c in r) for way, r in runs.items()}
    per_core = n_tokens / cpu_of[1]  # tokens per CPU-second of the script's one process
    startup = cpu_of[2] - cpu_of[1]
    shard_tokens = plan.C4_TOKENS_PER_SHARD
    shard_s = shard_tokens / per_core
    rounds = math.ceil(350 / 32)
    emit("- before issue 31 the main process decompressed and parsed every shard twice (a checking pass, "
         "then the batches it sent to the pool): it keeps at most tiktoken CPU s / (2 x gzip + JSON CPU s) "
         f"= {cpu / (2 * cpu_of['parse']):.1f} workers busy on this text, whatever the cores "
         "(less the pickling of the batches); now each worker reads its own shards and the main "
         "process only downloads and writes the index.")
    emit(f"- predicted for 350 C4 shards (~{shard_tokens / 1e6:.0f}M tokens each) with 32 workers: "
         f"{shard_s:.0f} s of tokenising per shard and worker, {rounds} rounds of 32 shards = "
         f"{rounds * shard_s / 60:.0f} min (plus about {startup:.1f} CPU-s to start each worker: the "
         f"2-worker run's extra CPU time), if the downloads keep up: 32 shards per {shard_s:.0f} s is "
         f"{32 * C4_SHARD_GZ_BYTES / shard_s / 1e6:.0f} MB/s of gzipped shards; below that the download (one "
         f"stream, in the main process) sets the pace: 350 x {C4_SHARD_GZ_BYTES / 1e6:.0f} MB at the link's "
         "speed.")
