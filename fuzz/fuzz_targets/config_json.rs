//! Any bytes as `config.json`: parsing and validating a model config (every family, K3's
//! wrapper included) and deriving its expert naming return a value or an error naming the
//! field, never panic; an accepted config's sizes are within the limits that keep allocation
//! bounded.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(data) else {
        return;
    };
    let _ = deltafin_inference::family::expert_naming(&v);
    if let Ok(c) = deltafin_inference::ModelConfig::from_json(&v) {
        assert!(c.num_hidden_layers() <= 4096);
        assert!(c.hidden_size() <= 1 << 17);
        assert!(c.vocab_size() <= 1 << 24);
        for l in 0..c.num_hidden_layers() {
            let _ = c.is_moe_layer(l);
        }
        let _ = c.eos_token_ids();
        let _ = c.widest_intermediate();
    }
});
