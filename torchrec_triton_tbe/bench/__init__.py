"""A/B benchmark of TritonTBE against FBGEMM's CUDA TBE, in the format of FBGEMM's own benchmark.

Mirrors ``fbgemm_gpu/bench/tbe/split_table_batched_embeddings_benchmark.py device``: the same options
and defaults, FBGEMM's request generator (both kernels see identical batches), FBGEMM's byte model and
log lines. Adds ``--compare fbgemm``, shape suites (``configs/suites/*.yaml``), JSON and PNG output.

    case.py     BenchCase (one shape and its options), the CLI parser, suite files
    batches.py  batches from FBGEMM's generator, and what the generator really produced
    timing.py   device-event timing (median, p20, p80), device copy bandwidth
    runner.py   builds both modules with identical weights, checks and times one case
    report.py   byte model, log lines, environment record, JSON and the plot
    cli.py      ``main(argv)``
"""
