"""Compute domain: server states, instance records, actions and faults."""
