"""Write a DeepSeek-V3-shaped Hugging Face checkpoint (config.json + bf16 safetensors, as
`deltafin synth` writes them) as a GGUF file for llama.cpp (arch `deepseek2`), with the `gguf`
package from the same llama.cpp tree and numpy only (llama.cpp's own converter needs torch).

It does what llama.cpp's convert_hf_to_gguf.py does for DeepseekV3ForCausalLM with
--outtype bf16: names from gguf's tensor map, routed experts stacked per layer into
ffn_{gate,up,down}_exps, kv_b_proj split into attn_k_b (transposed) and attn_v_b, norms, the
router and its correction bias in F32, everything else BF16, MLA as MQA (head_count_kv 1). The
vocabulary is left out (tokenizer.ggml.model = "none": llama.cpp makes vocab_size dummy
tokens, enough for llama-bench's random token ids).

    python3 benches/hf_to_gguf.py MODEL_DIR OUT.gguf
"""
import json
import os
import struct
import sys

import numpy as np
import gguf


def read_safetensors(path):
    """{name: (dtype, shape, memmapped bytes as a numpy array)}"""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    base = 8 + n
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        dt = {"BF16": np.uint16, "F32": np.float32, "F16": np.float16}.get(info["dtype"])
        if dt is None:
            continue  # integer buffers (none in a bf16 synth) are not weights
        arr = mm[base + a: base + b].view(dt).reshape(info["shape"])
        out[name] = (info["dtype"], arr)
    return out


def bf16_to_f32(a):
    return (a.astype(np.uint32) << 16).view(np.float32)


def main():
    src, dst = sys.argv[1], sys.argv[2]
    cfg = json.load(open(os.path.join(src, "config.json")))
    if cfg.get("architectures", [""])[0] != "DeepseekV3ForCausalLM":
        sys.exit("only DeepseekV3ForCausalLM checkpoints")
    tensors = {}
    for f in sorted(os.listdir(src)):
        if f.endswith(".safetensors"):
            tensors.update(read_safetensors(os.path.join(src, f)))
    n_layers = cfg["num_hidden_layers"]
    n_experts = cfg["n_routed_experts"]
    heads = cfg["num_attention_heads"]
    nope, rope, vdim = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    kv_lora = cfg["kv_lora_rank"]
    arch = gguf.MODEL_ARCH.DEEPSEEK2
    tmap = gguf.get_tensor_name_map(arch, n_layers)
    w = gguf.GGUFWriter(dst, gguf.MODEL_ARCH_NAMES[arch])

    w.add_name("deltafin synth")
    w.add_block_count(n_layers)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(1)  # MLA runs as MQA over the latent
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_expert_count(n_experts)
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_group_count(cfg.get("n_group", 1))
    w.add_expert_group_used_count(cfg.get("topk_group", 1))
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if cfg.get("scoring_func") == "sigmoid"
                             else gguf.ExpertGatingFuncType.SOFTMAX)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)
    w.add_leading_dense_block_count(cfg.get("first_k_dense_replace", 0))
    w.add_vocab_size(cfg["vocab_size"])
    if cfg.get("q_lora_rank") is not None:
        w.add_q_lora_rank(cfg["q_lora_rank"])
    w.add_kv_lora_rank(kv_lora)
    w.add_key_length(kv_lora + rope)
    w.add_value_length(kv_lora)
    w.add_key_length_mla(nope + rope)
    w.add_value_length_mla(vdim)
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_expert_shared_count(cfg.get("n_shared_experts", 0))
    if cfg.get("routed_scaling_factor") is not None:
        w.add_expert_weights_scale(cfg["routed_scaling_factor"])
    if cfg.get("norm_topk_prob"):
        w.add_expert_weights_norm(True)
    w.add_rope_dimension_count(rope)
    w.add_tokenizer_model("none")
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)

    def put(hf_name, arr, is_bf16):
        name = hf_name.replace("e_score_correction_bias", "e_score_correction.bias")
        new = tmap.get_name(name, try_suffixes=(".weight", ".bias"))
        if new is None:
            sys.exit(f"no GGUF name for {hf_name}")
        f32 = (arr.ndim <= 1 or new.endswith("_norm.weight") or ".ffn_gate_inp." in new
               or not new.endswith(".weight"))
        if f32:
            data = bf16_to_f32(arr) if is_bf16 else np.asarray(arr, dtype=np.float32)
            w.add_tensor(new, np.ascontiguousarray(data))
        elif is_bf16:
            w.add_tensor(new, np.ascontiguousarray(arr), raw_dtype=gguf.GGMLQuantizationType.BF16)
        else:
            # F32 weights (none in a bf16 synth) would be narrowed to BF16 here.
            data = np.asarray(arr, dtype=np.float32).view(np.uint32)
            data = ((data + 0x7FFF + ((data >> 16) & 1)) >> 16).astype(np.uint16)
            w.add_tensor(new, data, raw_dtype=gguf.GGMLQuantizationType.BF16)

    for name in sorted(tensors):
        dtype, arr = tensors[name]
        is_bf16 = dtype == "BF16"
        if ".mlp.experts." in name or not name.startswith(("model.", "lm_head.")):
            continue
        if name.endswith("kv_b_proj.weight"):
            kv_b = np.asarray(arr).reshape(heads, nope + vdim, arr.shape[-1])
            k_b = np.ascontiguousarray(kv_b[:, :nope, :].transpose(0, 2, 1))
            v_b = np.ascontiguousarray(kv_b[:, nope:, :])
            put(name.replace("kv_b_proj", "k_b_proj"), k_b, is_bf16)
            put(name.replace("kv_b_proj", "v_b_proj"), v_b, is_bf16)
            continue
        put(name, arr, is_bf16)
    for bid in range(n_layers):
        for proj in ("down_proj", "gate_proj", "up_proj"):
            first = f"model.layers.{bid}.mlp.experts.0.{proj}.weight"
            if first not in tensors:
                continue
            stack = np.stack([np.asarray(tensors[f"model.layers.{bid}.mlp.experts.{x}.{proj}.weight"][1])
                              for x in range(n_experts)])
            put(f"model.layers.{bid}.mlp.experts.{proj}.weight", stack,
                tensors[first][0] == "BF16")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()


if __name__ == "__main__":
    main()
