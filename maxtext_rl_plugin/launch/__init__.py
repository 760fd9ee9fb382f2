"""Cluster launchers: XPK create-pathways and Ray JaxTrainer."""
