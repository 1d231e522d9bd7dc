"""LoRA adapters on a served model: PEFT files read and checked, adapter slots on the device,
and the layers that add each row's adapter delta inside one batched step."""
