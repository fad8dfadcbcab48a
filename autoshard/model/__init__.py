"""The model file: loading build_model()/example_inputs(), materialising weights."""
