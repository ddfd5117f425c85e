"""Prompt datasets in verl's Parquet schema: conversion (GSM8K), synthetic verifiable
tasks for CPU runs, and a streaming reader with filtering, chat templates,
deterministic shuffling and a resumable cursor."""
