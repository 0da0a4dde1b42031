"""The parameter-server runtime under the `dist_*` KVStore types (ps-lite's roles, in Python).

Wire protocol and its schema (`protocol`, `schema`), transport security (`security`,
`strangers`), the scheduler and its link (`scheduler`, `scheduler_link`), the server and its
updaters (`server`, `updater`), a server's shard of a row-sparse key (`rows`), the worker's link
to the servers (`worker`) and where a key's parts and a table's rows live (`parts`), 2-bit compression (`compression`), the `DMLC_*` environment of a role
(`cluster_env`) and the entry point that runs a scheduler or server by role (`node`). Nothing
here imports TensorFlow, the trainer or the launcher: a server starts in well under a second.
"""
