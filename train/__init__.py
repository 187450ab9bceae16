"""The bundled training loop (installed as ``jax_twell.train``), one job per module:

    config       TrainConfig dataclasses, presets, key=value overrides
    tokenizer    byte-level (default) and BPE tokenizers
    data         corpus discovery (Python stdlib by default), held-out split, batch of step k
    optimizer    AdamW, linear warm-up + cosine decay, gradient clipping
    loss         cross-entropy + l1_coef * mean-over-layers per-token L1 of the FFN activations
    sharding     (data, fsdp, tensor) mesh, batch placement, multi-host start
    state        TrainState and its sharded initialisation
    dead_neurons dead-neuron tracking and gate re-initialisation
    step         the jitted train step (gradient accumulation) and eval step
    checkpoint   orbax checkpoints, verified on restore, never of a non-finite state
    lock         one run per work directory (train.lock)
    metrics      FLOPs, MFU, JSONL log, console lines
    evaluate     held-out cross-entropy, bits per byte, sampling
    trainer      the loop: train(cfg), resume, SIGTERM, the non-finite guard
    plot         PNG plots of a run
    sweep        one run per L1 coefficient, table and plots
    bench        a sparse model against dense baselines of its shape (bench_measure: timing,
                 power, memory; bench_report: metrics, ratios, PNG)

Command line: ``jax-twell train|eval|generate|plot|sweep|bench`` (``jax_twell.cli``).
"""
