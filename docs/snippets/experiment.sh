tfkv-run +experiment=lstm_ptb epochs=2
