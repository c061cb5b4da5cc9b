"""KVarN (SPEC §4). Owned by the KVarN work."""
