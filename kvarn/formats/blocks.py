"""llama.cpp block types (SPEC §3). Owned by the formats-standard work."""
