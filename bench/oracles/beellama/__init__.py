"""BeeLlama (the KVarN fork of llama.cpp) as the oracle (bench/oracles/beellama/README.md)."""
