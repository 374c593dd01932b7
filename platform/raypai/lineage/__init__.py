"""Lineage: the chain from any artifact back to the raw files (and forward), as stored in the
metadata store.

    upstream(store, artifact_id)     # graph.py: the tree of steps and inputs that made it
    deployment_lineage(store, settings, "tinychat")   # deploy.py: served versions → ... → raw files
    lineage_router(settings, store)  # api.py: the same as JSON under /api/v1/lineage (FastAPI)
"""

from raypai.lineage.graph import downstream, openlineage_events, sources, upstream

__all__ = ["upstream", "downstream", "sources", "openlineage_events"]
