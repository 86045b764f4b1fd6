"""Synthetic calibration documents: deterministic, one target fact among same-form distractors."""

from __future__ import annotations

import re

from kvmem_core.synthetic import FACTS, SURROUNDINGS, make_doc, make_docs


def test_same_seed_same_document():
    assert make_doc(7) == make_doc(7)
    assert make_doc(7).text != make_doc(8).text


def test_fact_span_holds_the_answer_once_and_the_question_names_its_entity():
    for doc in make_docs(10):
        fact = doc.text[doc.fact_span[0] : doc.fact_span[1]]
        assert doc.answer in fact and doc.text.count(doc.answer) == 1
        entity = next(
            w for w in re.findall(r"[A-Z][a-z]+", fact) if w in doc.question and w not in ("The", "Locker", "Agent")
        )
        assert doc.text.count(entity) == 1


def test_distractors_share_the_template_with_other_entities_and_codes():
    for seed in range(8):
        doc = make_doc(seed, n_distractors=5)
        template = FACTS[seed % len(FACTS)][0]
        pattern = re.escape(template).replace(r"\{e\}", r"([A-Z][a-z]+)").replace(r"\{c\}", r"(\d{5})")
        found = re.findall(pattern, doc.text)
        assert len(found) == 6
        assert len({name for name, _ in found}) == 6


def test_documents_cycle_through_every_surrounding_and_template():
    docs = make_docs(len(SURROUNDINGS) * len(FACTS))
    assert all(d.question.endswith("?") for d in docs) and len({d.question.split()[1] for d in docs}) == len(FACTS)
    assert any('{"id"' in d.text for d in docs) and any(" INFO " in d.text for d in docs)
    assert any("def total_" in d.text or "class Record" in d.text for d in docs)
    assert any("Assistant:" in d.text for d in docs)
