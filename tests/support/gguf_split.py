"""Write a GGUF as a llama.cpp split set (``NAME-0000i-of-0000N.gguf``), as `llama-gguf-split` does.

The ``gguf`` package's own writer does the splitting: the model's metadata goes
into part 1, ``split.no`` / ``split.count`` / ``split.tensors.count`` into every
part, and the tensors, byte for byte as in the source, spread over the parts.
"""

from __future__ import annotations

from pathlib import Path


def split_gguf(src: Path, dest: Path, parts: int) -> tuple[Path, ...]:
    """``src`` rewritten as ``parts`` files named after ``dest`` (its stem); returns them in order."""
    import gguf

    reader = gguf.GGUFReader(str(src), "r")
    per_part = -(-len(reader.tensors) // parts)
    arch = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(str(dest), arch, split_max_tensors=per_part)
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue  # written by the writer itself
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    for t in reader.tensors:
        writer.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    out = tuple(Path(dest).with_name(f"{Path(dest).stem}-{i:05d}-of-{parts:05d}.gguf") for i in range(1, parts + 1))
    assert all(p.is_file() for p in out), f"the writer did not make {parts} parts of {src}"
    return out


def single_and_split(root: Path, layers: int, parts: int = 3) -> tuple[Path, tuple[Path, ...]]:
    """A tiny GGUF model (with ``rope_freqs``) in ``root/one`` and the same model split into ``parts``
    files in ``root/set``: the pair every split-set test compares."""
    from tests.support.gguf import write_tiny_gguf

    (root / "one").mkdir()
    (root / "set").mkdir()
    single = write_tiny_gguf(root / "one" / "tiny.gguf", layers=layers, rope_freqs=True)
    return single, split_gguf(single, root / "set" / "tiny.gguf", parts=parts)

