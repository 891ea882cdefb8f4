"""The benchmark: what each technique buys, measured side by side on the machine at hand.

    python -m manual_train.bench --suite cpu --quick     # docs/benchmarks.md shows a run
    python -m manual_train.bench --suite gpu --quick     # on a CUDA machine; scripts/gpu_check.sh runs it

Every entry runs a baseline and its variant interleaved (A B A B ...) after a warm-up, repeats that,
and reports the median of the per-repeat ratios with their min-max spread, next to what the source
articles claimed and the project's goal where one is set (met or not: the number is reported either way).

  cli.py      flags, the loop over entries (tqdm), writing the outputs
  harness.py  fresh measurement processes, peak RSS, interleaving, the Row/Goal/Outcome records
  cpu.py      the CPU entries          gpu.py  the GPU entries, FLOP counting and MFU
  report.py   machine info, Markdown table, bench.json, the PNG chart
"""
