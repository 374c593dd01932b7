"""Operator and developer tooling around the core, not used by pipelines or steps:

cluster.py   build the raypai wheel, submit a pipeline through the Ray Jobs API (`raypai submit`)
services.py  the production services on one machine: MLflow + S3 server (`raypai services`)
doctor.py    install and service checks (`raypai doctor`)
parity.py    compare the records of two runs (embedded vs production; benchmarks/production_run.py)
"""
