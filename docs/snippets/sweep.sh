tfkv-run -m optimizer.lr=0.1,0.02 kvstore=local,device devices=[cpu:0,cpu:1] epochs=2
