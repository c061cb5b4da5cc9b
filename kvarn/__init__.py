"""kvarn: how much does a quantized KV cache damage a language model?

The package holds every number the pipeline produces: KV-cache formats
(`kvarn.formats`), byte accounting (`kvarn.budget.memory`), the cache model inside
transformers (`kvarn.kvcache.cache`), the teacher-forced KLD engine (`kvarn.run.torch_engine`),
metrics (`kvarn.stats.metrics`) and the tables and figures (`kvarn.report`).
The numerics contract is docs/DESIGN.md ("DESIGN §N"); docs/CONTRACTS.md lists the
interfaces between modules.
"""

__version__ = "0.1.0"
