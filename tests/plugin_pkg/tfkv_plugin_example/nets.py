"""A model builder (imports Keras at the top, as most do)."""

import keras


def build(input_shape, num_classes, width=16, dropout=0.0, activation="relu", init=keras.initializers.GlorotUniform()):
    print(f"tinynet: width {width}, dropout {dropout}", flush=True)  # what the test looks for
    x = inputs = keras.Input(shape=input_shape)
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dense(width, activation=activation, kernel_initializer=init)(x)
    x = keras.layers.Dropout(dropout)(x)
    return keras.Model(inputs, keras.layers.Dense(num_classes)(x), name=f"tinynet{width}")
