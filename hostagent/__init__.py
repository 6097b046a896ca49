"""Ferry's host agent: the long-running process on each hypervisor (``python -m hostagent``).

It polls its host's SQS queue for operations, does the libvirt and disk work, answers the
workflows through Step Functions task tokens, and reports the host's inventory and liveness.
It never touches the database.
"""
