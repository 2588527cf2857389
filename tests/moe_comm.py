"""Count the collectives of one FSDP training step of small mixtures of experts (MOE_MODELS), as
tools/bench_systems.py's comm_child counts them (CollectiveBytes), and print one JSON line per model on
rank 0: the bytes each process sent by plan.py's ring convention and each expert weight's local
shape. Under torchrun, from the repository root:

    python -m torch.distributed.run --standalone --nproc_per_node=4 tests/moe_comm.py
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.getcwd())  # the repository's modules (the script's own folder is tests/)
import parallelism  # noqa: E402
from model import GPTConfig, build_model  # noqa: E402
from objective import Trained  # noqa: E402
from tools.bench_systems import CollectiveBytes  # noqa: E402

LLAMA = dict(vocab_size=42, block_size=16, n_layer=2, arch="llama", tie_weights=False, top_k=2)
MOE_MODELS = {  # on 4 ranks
    # (2, 32, 16) experts: dim 0 would leave 2 ranks empty; dim 1 divides
    "2 experts": dict(LLAMA, n_head=2, n_embd=16, n_expert=2, ffn_hidden=32),
    "8 experts": dict(LLAMA, n_head=2, n_embd=16, n_expert=8, ffn_hidden=32),  # dim 0 divides
    # (2, 30, 18): no dimension divides 4, so dim 0 is padded to 4 experts (the plan counts it)
    "2 experts, nothing divides": dict(LLAMA, n_head=3, n_embd=18, n_expert=2, ffn_hidden=30),
    # the 8x1B's expert shard on 64 ranks, (8, 5632 / 64 = 88, 2048), per expert: (2, 352, 2048) on 4
    "the 8x1B's expert shard": dict(LLAMA, n_layer=1, n_head=16, n_embd=2048, n_expert=2, ffn_hidden=352),
}


def main():
    rank, _, world = parallelism.init_distributed("cpu")
    for name, keys in MOE_MODELS.items():
        torch.manual_seed(0)
        model = build_model(GPTConfig(**keys))
        parallelism.parallelize(Trained(model, torch.nn.Module()), "fsdp", "cpu")
        x = torch.randint(0, keys["vocab_size"], (1, keys["block_size"]))
        with CollectiveBytes() as counter:
            logits = model(x)
            (logits.float().square().mean() + model.aux_loss).backward()
        share = (world - 1) / world
        sent = {kind: buffer * share * (2 if kind == "all_reduce" else 1) for kind, buffer in counter.buffers.items()}
        expert = model.h[0].mlp.gate
        if rank == 0:
            print(json.dumps({"model": name, "processes": world, "sent": sent, "other": counter.other,
                              "expert_local_shape": list(expert.to_local().shape),
                              "expert_placement": str(expert.placements[0])}), flush=True)
    parallelism.shutdown()


if __name__ == "__main__":
    main()
