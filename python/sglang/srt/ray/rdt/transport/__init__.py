"""Transports of RDT weight sync: how bytes move between processes (modules: docs/architecture.md). May import
torch, numpy, Ray and each other; never the engine or trainer sides, nor sglang's serving modules."""
