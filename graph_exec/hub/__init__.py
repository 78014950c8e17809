"""Hugging Face model directories as files, with numpy alone (no MindSpore): safetensors shards
and their index read by byte range, BF16/F16 read and written exactly (:mod:`.dtypes`,
:mod:`.directory`)."""
