"""The one reading of blend files: what the loader parses and what S3 staging rewrites agree line by line."""

from runtime.schema.data_prefix import map_blend_prefixes, read_blend_file


def test_rewriting_keeps_everything_but_the_prefix(tmp_path):
    text = ("# weight prefix corpus\n\n0.75 s3://bucket/a news  # the news\n0.25 local/b\n"
            "0 s3://bucket/empty\n")
    rewritten, prefixes = map_blend_prefixes(
        text, lambda p: "/fsx/staging/" + p.removeprefix("s3://") if p.startswith("s3://") else None)
    assert prefixes == ["s3://bucket/a", "local/b", "s3://bucket/empty"]
    assert rewritten.splitlines() == ["# weight prefix corpus", "", "0.75 /fsx/staging/bucket/a news # the news",
                                      "0.25 local/b", "0 /fsx/staging/bucket/empty"]
    blend = tmp_path / "blend.txt"
    blend.write_text(rewritten)
    entries = read_blend_file(blend)  # the loader reads the rewritten file as the same blend
    assert [(e.weight, e.prefix) for e in entries] == [(0.75, "/fsx/staging/bucket/a"),
                                                       (0.25, str(tmp_path / "local/b"))]
    assert map_blend_prefixes(rewritten, lambda p: None)[0] == rewritten
