"""The hand-written evaluation samples (`configs/eval/standard_tiny.yaml`): GSM8K-shaped
problems with worked solutions ending in ``#### N``, and MMLU-shaped multiple-choice questions
(`posttrain.eval.benchmarks`). `tools/make_assets.py` writes them to ``assets/data/eval/``; they
are not in the tokenizer's training corpus."""

GSM8K_SAMPLE = [{'question': 'A baker makes 24 muffins in the morning and 18 in the afternoon. She sells 35 '
              'of them. How many muffins does she have left?',
  'answer': 'She makes 24 + 18 = <<24+18=42>>42 muffins.\n'
            'After selling 35 she has 42 - 35 = <<42-35=7>>7 left.\n'
            '#### 7'},
 {'question': 'Tom reads 12 pages a day. How many pages does he read in 3 weeks?',
  'answer': '3 weeks are 3 * 7 = <<3*7=21>>21 days.\n'
            'He reads 12 * 21 = <<12*21=252>>252 pages.\n'
            '#### 252'},
 {'question': 'A bike costs $1,250. Maria has saved $480 and earns $110 a week. How many more '
              'weeks must she work to buy the bike?',
  'answer': 'She still needs 1250 - 480 = <<1250-480=770>>770 dollars.\n'
            'That takes 770 / 110 = <<770/110=7>>7 weeks.\n'
            '#### 7'},
 {'question': 'A tank holds 1,500 liters of water. It leaks 45 liters an hour for 12 hours. '
              'How many liters are left?',
  'answer': 'It leaks 45 * 12 = <<45*12=540>>540 liters.\n'
            '1500 - 540 = <<1500-540=960>>960 liters are left.\n'
            '#### 960'},
 {'question': 'Sam buys 4 notebooks at $2.50 each and a pen for $1.75. He pays with a $20 '
              'bill. How much change does he get?',
  'answer': 'The notebooks cost 4 * 2.50 = <<4*2.5=10>>10 dollars.\n'
            'With the pen he spends 10 + 1.75 = <<10+1.75=11.75>>11.75 dollars.\n'
            'His change is 20 - 11.75 = <<20-11.75=8.25>>8.25 dollars.\n'
            '#### 8.25'}]

MC_SAMPLE = [{'question': 'Which gas do plants take in from the air to make food?',
  'subject': 'biology',
  'choices': ['Oxygen', 'Carbon dioxide', 'Nitrogen', 'Helium'],
  'answer': 1},
 {'question': 'What is the boiling point of water at sea level in degrees Celsius?',
  'subject': 'physics',
  'choices': ['0', '50', '100', '212'],
  'answer': 2},
 {'question': 'Which planet is closest to the Sun?',
  'subject': 'astronomy',
  'choices': ['Venus', 'Earth', 'Mars', 'Mercury'],
  'answer': 3},
 {'question': 'How many sides does a hexagon have?',
  'subject': 'mathematics',
  'choices': ['Five', 'Six', 'Seven', 'Eight'],
  'answer': 1},
 {'question': 'Which of these is a mammal?',
  'subject': 'biology',
  'choices': ['Shark', 'Salmon', 'Dolphin', 'Octopus'],
  'answer': 2}]
