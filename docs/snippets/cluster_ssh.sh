tfkv-run +experiment=cifar_resnet18 dataset.root=~/data/cifar-10-batches-py \
    kvstore=dist_sync cluster=ssh cluster.hostfile=hosts cluster.sync_dst_dir=/tmp/job
