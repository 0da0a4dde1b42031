tfkv-run kvstore=dist_sync cluster=local cluster.num_workers=2 cluster.num_servers=1 epochs=2
