"""The garbage collector's settings for test processes (workers, ranks, fork-server children).

A compile allocates millions of small objects (Dynamo's variable trackers, FX nodes, fake tensors); with Python's
default thresholds (700, 10, 10) the collector runs ~9,000 times over a file of compile tests and its full
collections walk the whole heap, torch and transformers included: 12-13 of ~100 CPU-s on
tests/passes/inject_lora + tests/passes/apply_autocast, measured on this 2-core machine (2026-12-01). Freezing
what the imports made (never garbage) and collecting the young generation every 50,000 allocations instead: 197
collections, 3.5-5.8 CPU-s; paired whole-process runs of tests/passes/apply_autocast + scale_loss: CPU median 68.6 s
vs 78.1 s (A/B 0.916), peak RSS 725 vs 659 MiB (bench/results/suite_cuts_cpu.md). Full collections still run
(every 20 x 20 young ones), so cyclic garbage of finished tests is freed. Test processes only: effpass never
changes a user's collector."""
import gc

THRESHOLDS = (50_000, 20, 20)


def tune() -> None:
    """Freeze what exists now (imports) and raise the thresholds; call after the heavy imports."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*THRESHOLDS)
