"""Model-agnostic primitives for ``shard_map`` bodies: they know no model.

collectives  documented wrappers; ring / bidirectional versions built only from ppermute
tensor       column / row-parallel dense, head-split attention (RoPE hook, KV repeat), the TP
             MLP and its gated (SwiGLU) form, Megatron f / g
lm           decoder-LM pieces: RMSNorm, RoPE, packed-document positions, vocab-parallel
             embedding, logits and cross-entropy (logits never gathered), padded targets
sequence     ring attention, Ulysses, USP (bidirectional or causal); token padding and masks
             (ring: the ring itself; blockwise: the block math and attention_local)
layouts      token layouts over a seq axis (contiguous, zigzag, striped) and their permutations
data         gradient sync (float32 or bf16), gradient norms, FSDP gather, ZeRO-1/2
tiles        FSDP / ZeRO buckets on a TPU: the [r, 128] tiles its compiler keeps (probed)
moe          mixture of experts: top-k router, capacity dispatch / combine, expert FFN, the
             balancing losses, expert parallelism by all-to-all over an expert axis
schedules    pipeline schedules as data (GPipe, 1F1B, interleaved, ZB-H1)
pipeline     the engine that runs any schedule over a stage axis
"""
