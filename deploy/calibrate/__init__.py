"""``vlkv calibrate`` and ``vlkv calibrate-reuse``: profiles a served checkpoint loads, measured on its own
prompts."""
