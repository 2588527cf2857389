"""
The comparison grids: which methods, which config files, how many seeds,
and the papers' numbers to print beside ours. A method is one config file
(a tuple of them is a chain: stage k starts from stage k-1's best.pt).
results/README.md says what each grid is for and why it has its seeds.
"""

import os

SEEDS = list(range(1337, 1367))  # 30 seeds; a method uses the first n
# issue 40's fresh seeds, never run before results/preregistration.md was committed
FRESH_SEEDS = list(range(1367, 1391))
# issue 40's embedding swap: the blocks' seed -> the seed whose embeddings
# the run starts from; a crossing and a non-crossing seed each way
EMBEDDING_SWAPS = {1342: 1337, 1337: 1342, 1346: 1338, 1338: 1346}

# method -> (config file(s), the first n of SEEDS or a list of seeds); the
# first is the baseline
GRIDS = {
    "jostling": {
        "baseline": ("config/lowres_ce.py", 30),
        "margin 2": ("config/lowres_margin_2.py", 5),
        "margin 1": ("config/lowres_margin_1.py", 5),
        "margin 0.6": ("config/lowres_margin_0.6.py", 30),
        "margin 0.6 + SE": ("config/lowres_margin_0.6_se.py", 10),
        "monolingual": ("config/lowres_monolingual.py", 5),
        # weight decay on the rows under SE as the paper's text means it (docs/fidelity.md)
        "margin 0.6 + SE, rows not decayed": ("config/lowres_margin_0.6_se_rows_no_decay.py", 5),
    },
    "lowres": {
        "CE": ("config/lowres_ce.py", 10),
        "margin 0.6": ("config/lowres_margin_0.6.py", 10),
        "margin 0.6 + SE": ("config/lowres_margin_0.6_se.py", 10),
        "SimReg": ("config/lowres_simreg.py", 5),
        "SimReg chunk 32": ("config/lowres_simreg_chunk.py", 5),
        "dispersion": ("config/lowres_dispersion.py", 5),
        "dispersion decorrelation": ("config/lowres_dispersion_decorrelation.py", 5),
        "dispersion l2_repel": ("config/lowres_dispersion_l2_repel.py", 5),
        "dispersion orthogonalization": ("config/lowres_dispersion_orthogonalization.py", 5),
        # the three as the authors' released code has them (docs/fidelity.md);
        # decorrelation is the same in both forms
        "dispersion, authors' form": ("config/lowres_dispersion_authors.py", 5),
        "dispersion l2_repel, authors' form": ("config/lowres_dispersion_l2_repel_authors.py", 5),
        "dispersion orthogonalization, authors' form":
            ("config/lowres_dispersion_orthogonalization_authors.py", 5),
        "NITP": ("config/lowres_nitp.py", 5),
        "CWT + FT": (("config/lowres_cwt.py", "config/lowres_cwt_ft.py"), 5),
        "SimReg + dispersion": ("config/lowres_simreg_dispersion.py", 5),
        # issue 40, T6: the released l2_repel with its norm term alone
        "dispersion l2_repel norm term alone, authors' form":
            ("config/lowres_dispersion_l2_norm_authors.py", 5),
    },
    "bpe": {  # the same methods on the GPT-2 BPE toy (config/bpe_baseline.py)
        "CE": ("config/bpe_baseline.py", 5),
        "margin 0.6 + SE": ("config/bpe_margin_0.6_se.py", 5),
        "SimReg": ("config/bpe_simreg.py", 5),
        "SimReg chunk 32": ("config/bpe_simreg_chunk.py", 5),
        "dispersion": ("config/bpe_dispersion.py", 5),
        "dispersion decorrelation": ("config/bpe_dispersion_decorrelation.py", 5),
        "dispersion l2_repel": ("config/bpe_dispersion_l2_repel.py", 5),
        "dispersion orthogonalization": ("config/bpe_dispersion_orthogonalization.py", 5),
        "NITP": ("config/bpe_nitp.py", 5),
        "CWT + FT": (("config/bpe_cwt.py", "config/bpe_cwt_ft.py"), 5),
        "SimReg + dispersion": ("config/bpe_simreg_dispersion.py", 5),
    },
    "bpe_1600": {  # issue 40, T7: 4x the steps, the schedule scaled
        "CE": ("config/bpe_baseline_1600.py", 5),
        "SimReg": ("config/bpe_simreg_1600.py", 5),
        "SimReg chunk 32": ("config/bpe_simreg_chunk_1600.py", 5),
    },
    "bpe_rare": {  # issue 44: bpe's runs again, rare targets at PPL_best
        "CE": ("config/bpe_baseline.py", 5),
        "margin 0.6 + SE": ("config/bpe_margin_0.6_se.py", 5),
    },
    "jostling_prereg": {  # issue 40, pre-registered
        "baseline": ("config/lowres_ce.py", FRESH_SEEDS),
        "margin 0.6": ("config/lowres_margin_0.6.py", FRESH_SEEDS),
    },
    "jostling_swap": {  # issue 40: the embedding swap (EXTRA_RUNS)
        "margin 0.6": ("config/lowres_margin_0.6.py", sorted(EMBEDDING_SWAPS)),
    },
}

# Runs of a grid that are not methods of its tables: name -> (config file(s),
# seeds, extra train.py arguments or a function of the seed giving them).
# jostling's factorial of margin 0.6 (docs/statistics.md) pairs the
# initialisation of one seed with the data order of another, at least one
# of them a crossing one (it makes the LR transition).
CROSSING_SEEDS = (1342, 1346)
NON_CROSSING_SEEDS = (1337, 1338, 1339)
MARGIN_0_6 = "config/lowres_margin_0.6.py"
FACTORIAL_SEEDS = sorted(CROSSING_SEEDS + NON_CROSSING_SEEDS)
EXTRA_RUNS = {
    "jostling": {
        f"margin 0.6, data order of {data}": (
            MARGIN_0_6,
            [s for s in FACTORIAL_SEEDS
             if s != data and (s in CROSSING_SEEDS or data in CROSSING_SEEDS)],
            (f"--data_seed={data}",))
        for data in CROSSING_SEEDS + NON_CROSSING_SEEDS
    },
    "jostling_prereg": {
        "margin 0.6, data order of the next seed": (
            MARGIN_0_6, FRESH_SEEDS, lambda seed: (f"--data_seed={seed + 1}",)),
    },
    "jostling_swap": {
        "margin 0.6, embeddings swapped": (
            MARGIN_0_6, sorted(EMBEDDING_SWAPS),
            lambda seed: (f"--init_embeddings_from_seed={EMBEDDING_SWAPS[seed]}",)),
        "margin 0.6, embeddings swapped, data order of the embeddings' seed": (
            MARGIN_0_6, sorted(EMBEDDING_SWAPS),
            lambda seed: (f"--init_embeddings_from_seed={EMBEDDING_SWAPS[seed]}",
                          f"--data_seed={EMBEDDING_SWAPS[seed]}")),
    },
}

# Finished runs archived without a run.json (its write was lost): grid ->
# {(method, seed)}; a comparison refuses any other run without one.
UNRECORDED_RUNS = {
    "jostling": {("baseline", 1339), ("baseline", 1340)},
    "jostling_prereg": {("margin 0.6, data order of the next seed", 1368)},
}

# A comparison pairs two runs on one seed only when both ran the same code on
# the same CPU model, unless their grid is here, with why its runs pool.
_NO_COMMIT = "archived before run.json recorded the commit"
_TWO_CPUS = f"{_NO_COMMIT}; trained on an Intel Xeon and an AMD EPYC machine"
POOLABLE = {
    "jostling": _TWO_CPUS,
    "lowres": _TWO_CPUS,
    "bpe": _NO_COMMIT,
    "jostling_prereg": "the archive's seeds were trained before run.json recorded the commit, "
                       "the fresh seeds on an uncommitted tree whose changes were not hashed",
    "jostling_swap": _NO_COMMIT,
}
# a grid that trains another's runs again: its report says how far they moved
RERUN_OF = {"bpe_rare": "bpe"}

# train.py arguments every run of a grid gets (bpe_1600's GPU: a deviation
# results/README.md names)
GRID_ARGS = {
    "bpe_1600": ("--device=cuda", "--dtype=float32", "--compile=False"),
}

# The authors' numbers, HR / LR: margins 2 and 1 from Stop Jostling's Table 7; the baseline and
# margin 0.6 + SE from the authors' published code, one seed each (the paper's text gives LR
# PPL_best 10.63 -> 6.11 for its best run: close to, not the same as, that row).
# (ppl, ppl_best, t_best, acc, r@5, mrr, I(W))
PAPER = {
    "jostling": {
        "baseline": [(5.04, 10.65), (5.01, 10.63), (1.08, 0.95),
                     (.519, .315), (.830, .688), (.654, .480), (.842, .417)],
        "margin 2": [(5.82, 11.56), (5.07, 9.62), (0.71, 0.67),
                     (.529, .358), (.834, .717), (.661, .516), (.850, .642)],
        "margin 1": [(9.33, 17.30), (5.13, 9.54), (0.48, 0.46),
                     (.530, .371), (.834, .720), (.663, .526), (.888, .765)],
        "margin 0.6 + SE": [(14.94, 19.94), (5.15, 6.17), (0.34, 0.32),
                            (.527, .487), (.836, .809), (.661, .628), (.893, .762)],
    },
}
METRICS = ["ppl", "ppl_best", "t_best", "accuracy", "recall_at_5", "mrr", "isotropy"]

# the LR accuracy of the authors' single notebook run, and the one from which
# we say a seed made the jump towards it
PAPER_SE_LR_ACCURACY = 0.487
TRANSITION_LR_ACCURACY = 0.43


def run_dir(root, grid, method, seed):
    return os.path.join(root, grid, method.replace(" ", "_").replace("+", "plus"), f"seed{seed}")


def runs_of(grid, root):
    """(method, seed, config, train.py arguments (GRID_ARGS, then the run's
    own), directory) of every run of the grid (GRIDS and EXTRA_RUNS),
    seed-major: every method's first seed, then every method's second...,
    so that a grid cut short still holds paired runs."""
    runs = {method: (config, SEEDS[:seeds] if isinstance(seeds, int) else list(seeds), ())
            for method, (config, seeds) in GRIDS[grid].items()}
    runs.update(EXTRA_RUNS.get(grid, {}))
    for seed in sorted({seed for _, seeds, _ in runs.values() for seed in seeds}):
        for method, (config, seeds, args) in runs.items():
            if seed in seeds:
                own = args(seed) if callable(args) else args
                yield (method, seed, config, (*GRID_ARGS.get(grid, ()), *own),
                       run_dir(root, grid, method, seed))
