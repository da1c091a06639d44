"""Drop-in integrations of safemoe into model libraries.

`safemoe.integrations.transformers.patch(model)` swaps the MoE blocks of Hugging Face transformers
(v5) models for `safemoe.MoE`, reusing the model's weights. Imported lazily: importing safemoe does
not import transformers.
"""
