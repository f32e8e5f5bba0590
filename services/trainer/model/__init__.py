"""The model the trainer trains: the DeepSpeed backend, the flat AdamW, LoRA through peft, and the export of full
HF-named weights for a sync."""
