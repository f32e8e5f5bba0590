"""`tandem init-model`: small local models of a known family (architecture presets, a trained byte-level BPE
tokenizer), so no run downloads anything."""
