"""Published LLaMA shapes, shared by synthetic models (`synthetic:llama-7b`) and the simulator's presets.

Torch-free, so the simulator can import it without the engine.
"""

# Touvron et al. 2023a/b. LLaMA-1 has no GQA; LLaMA-2-70B has 8 KV heads.
LLAMA_SHAPES: dict[str, dict] = {
    "llama-7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32, num_heads=32, num_kv_heads=32, max_position=2048),
    "llama-13b": dict(vocab_size=32000, hidden_size=5120, intermediate_size=13824, num_layers=40, num_heads=40, num_kv_heads=40, max_position=2048),
    "llama-33b": dict(vocab_size=32000, hidden_size=6656, intermediate_size=17920, num_layers=60, num_heads=52, num_kv_heads=52, max_position=2048),
    "llama2-7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32, num_heads=32, num_kv_heads=32, max_position=4096),
    "llama2-70b": dict(vocab_size=32000, hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64, num_kv_heads=8, max_position=4096),
}
