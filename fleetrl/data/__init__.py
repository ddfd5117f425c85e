"""Prompt datasets in verl's Parquet schema: conversion (GSM8K), synthetic verifiable
tasks for CPU runs, a streaming reader with filtering, deterministic shuffling and a
resumable cursor, and the one rendering of prompts and reward-model inputs
(``fleetrl.data.render``: chat templates, BOS, the EOS a reward model is scored at)."""
