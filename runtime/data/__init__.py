# Training data: Megatron indexed datasets, GPT sample indices, weighted blends and data-parallel batches.
from runtime.data.blend import BlendedDataset, blend_index
from runtime.schema.data_prefix import BlendEntry, parse_data_prefix, read_blend_file
from runtime.data.gpt_dataset import GPTDataset, build_sample_index, parse_splits, split_document_ranges
from runtime.data.indexed import DTYPE_CODES, IndexedDataset
from runtime.data.loader import DataParallelBatches, build_split_dataset

__all__ = [
    "BlendEntry",
    "BlendedDataset",
    "DTYPE_CODES",
    "DataParallelBatches",
    "GPTDataset",
    "IndexedDataset",
    "blend_index",
    "build_sample_index",
    "build_split_dataset",
    "parse_data_prefix",
    "parse_splits",
    "read_blend_file",
    "split_document_ranges",
]
