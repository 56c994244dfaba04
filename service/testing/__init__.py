"""What tests of a kvhandoff deployment use: a local multi-process deployment (`deployment`) and
raw Mooncake in its topology as a baseline (`raw_engines`). Installed with the package, for
kvhandoff's own tests, its demo and benchmarks, and integrators' CI (docs/guides/testing.md)."""
