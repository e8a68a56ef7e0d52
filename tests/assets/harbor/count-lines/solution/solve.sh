#!/bin/bash
# The reference solution (Harbor's oracle agent runs it): the sandbox environment passes with it.
wc -l < notes.txt > answer.txt
