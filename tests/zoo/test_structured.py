import json

from spin.zoo.structured import structured_documents


def test_same_seed_same_documents() -> None:
    assert list(structured_documents(30, seed=7)) == list(structured_documents(30, seed=7))
    assert list(structured_documents(30, seed=7)) != list(structured_documents(30, seed=8))


def test_every_kind_appears_with_its_format() -> None:
    docs = dict(structured_documents(200, seed=1))
    kinds = {doc_id.split("/")[1] for doc_id in docs}
    assert kinds == {"json_records", "log_lines", "table", "ini"}
    for doc_id, text in docs.items():
        if doc_id.split("/")[1] == "json_records" and "\n  " not in text:  # one record per line
            for line in text.splitlines():
                json.loads(line)
        if doc_id.split("/")[1] == "ini":
            assert text.startswith("[") and "port = " in text
